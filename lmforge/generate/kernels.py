"""Matrix-vector products for batch-1 decoding on CUDA, written in Triton, and the layers that
use them.

A batch-1 decode step reads every weight once for a handful of multiply-adds per byte, so it
runs as fast as the weights stream from memory. Measured on an H200 one product at a time
(benchmarks/gemv.py, docs/benchmarks.md), `_gemv` reads the 1B's bf16 weights at 3.0-3.9 TB/s
where inductor's tuned reductions (what the compiled step made of them before) read them at
2.4-3.5 TB/s (the output projection: 134 against 201 us), and the 1B decodes 19% faster, the 3B
26%. `_gemv` keeps a [BLOCK_N, BLOCK_K] fp32 accumulator over the whole row and reduces it once
at the end, so its loop is loads, conversions and fused multiply-adds only.

Layouts (`bits`): 16: the weight as it is; 8: int8 q [N, K], or uint8 q + 128 as `QuantizedLinear`
keeps it (the bytes the kernels' byte permutes read); 4: uint8 [N, K/2], byte j of a row holding
q[j] in its low and q[j + K/2] in its high nibble (so a tile reads two contiguous runs of x). A
quantized weight is w = q * scale (int8, symmetric) or (q - 8) * scale + zero (int4, tinygemm's
convention), scale and zero [N, K / group]. With more than one row of activations (batched
decoding, prefill), a quantized weight is expanded to bf16 by `_dequantize` and multiplied by
cuBLAS: at 64 rows on an H200 torchao's int8 kernel took 0.6-4.8 ms a product of the 1B, this 10-57
us. Which weights come here (`quantized_values`): int8 and the int4 made on the CPU, and tinygemm's
int4 (made on CUDA) converted where the engine decodes one sequence at a time and for lm-eval's
scoring: at one row bf16-activation int4 runs in packed fp16 (`_gemv_int4`; on an H200 the 1B
decoded 1.32-1.36x faster than on tinygemm, the 3B 1.27-1.29x, docs/benchmarks.md), and at 64 rows
tinygemm took 2x as long as the bf16 expansion.

A single-row product can take the decode block's work around it into the same kernel: the
RMSNorm of its input, SiLU·up, a residual add (`gemv`'s arguments, `FusedDecodeBlock`). One
without a norm or SiLU·up may share each row among 2 or 4 programs (split-K, `_combine`).

The ops are registered with torch.library, so torch.compile treats them as opaque kernels and
a CUDA graph records them. Under TRITON_INTERPRET=1 they run on the CPU (the tests).
"""

from __future__ import annotations

import json
import logging
import os
from functools import cache, partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from lmforge.generate import quantized_gemm
from lmforge.generate.decode_attention import decode_attention, supported
from lmforge.generate.early_launch import INTERPRETED, early_launch, wait_for_previous
from lmforge.modules.kv_cache import StaticKVCache

log = logging.getLogger(__name__)

# inline PTX in the kernels (NVIDIA GPUs; not the interpreter, not ROCm)
ASSEMBLY = tl.constexpr(not INTERPRETED and torch.version.hip is None)
# Launched early, a GEMV loads its first weight tiles before its wait: how many, by the weight's
# bits. On an H200 (2026-12-02, docs/benchmarks.md: each tuned in its own process, twice in
# turn) the 1B decoded bf16 at 1,215-1,217 tok/s with one tile against 1,171-1,178 with two,
# int8 at 1,417-1,420 with two against 1,380-1,386 with one: about the same bytes in flight.
PRELOAD = {16: 1, 8: 2, 4: 2}
# int4 nibbles made floats from their bit patterns (`_int4_values`: 1.5 instructions a weight)
# instead of by the integer-to-float converter: on an H200 the 1B's int4 on the GEMV decoded at
# 754.3 tok/s against 712.4 (2026-12-02, docs/benchmarks.md; benchmarks/decode.py variants
# lmforge-gemv-int4 and lmforge-gemv-int4-converter, now lmforge-int4-bytes and
# lmforge-int4-converter).
INT4_FROM_BITS = True
# int8 weights of one scale a row may be made floats 1 + (q + 128) / 2^15 by one byte permute
# each (`_int8_biased`), the bias taken off the whole product at the end with the sum of x: 1.25
# instructions a weight where `_int8_values` spends 2.25. Which one a product runs is tuned like
# its tile (`_candidates`): on an H200 (2026-12-02, docs/benchmarks.md) biased everywhere
# decoded the 1B 8.7% faster than exact, the 3B 2.7% slower. False: exact only (the A/B in
# benchmarks/decode.py, variant lmforge-int8-exact). Never for an fp32 model: its sums keep
# ~15 bits where the exact conversion keeps 24, visible in an fp32 output, not in a bf16 one.
INT8_BIASED = True
# `QuantizedLinear` keeps int8 weights as uint8 q + 128, the bytes `_int8_biased` and
# `_int8_values` set into floats' patterns: the xor that makes them (a quarter instruction a
# weight) is done once, at conversion. Compiled for sm_90 the 1B's int8 products take 4-5.5%
# fewer instructions (w13 1,296 SASS instructions a program instead of 1,360); on an H200
# (2026-12-03, docs/benchmarks.md) the 1B's int8 decoded 0.8% faster, the 3B's 1.3%. False:
# int8 as torchao stores it (the A/B in benchmarks/decode.py, variant lmforge-int8-signed).
INT8_OFFSET = True


@triton.jit
def _gemv(
    x_ptr,  # [K] activations; [2K] (gate, up) when GATED
    w_ptr,  # [N, K] (bf16, int8) or [N, K/2] (int4 pairs)
    scale_ptr,  # [N, groups] (quantized)
    zero_ptr,  # [N, groups] (int4)
    norm_ptr,  # [K] RMSNorm weight (NORM)
    residual_ptr,  # [N] (RESIDUAL)
    y_ptr,  # [N]
    partial_ptr,  # [SPLITS, N] fp32 (SPLITS > 1): each split's sums
    count_ptr,  # [N] int32 zeros (SPLITS > 1): a row block's splits done, back to 0 at the end
    N,
    K: tl.constexpr,  # (compiled for each: the loop and the scales' layout are static)
    eps,  # RMSNorm's (NORM)
    GROUP: tl.constexpr,  # columns a scale covers (K for one per row)
    BITS: tl.constexpr,
    NORM: tl.constexpr,  # x is the residual stream: the product takes RMSNorm(x)
    GATED: tl.constexpr,  # x is a gate and an up projection: the product takes silu(gate) * up
    RESIDUAL: tl.constexpr,  # y = residual + the product
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # stored columns a tile reads (within one group)
    X_TILE: tl.constexpr,  # x loaded as the weight tile's shape (not with GATED; `_x_tile`)
    EARLY: tl.constexpr,  # launched early (early_launch.py): wait for the kernel before
    PRELOAD: tl.constexpr,  # (EARLY) weight tiles loaded before the wait: 0, 1 or 2
    INT4_FROM_BITS: tl.constexpr = False,  # (BITS 4) `_int4_values`, not the converter
    INT8_BIASED: tl.constexpr = False,  # (BITS 8, one scale a row) `_int8_biased`
    SWIGLU: tl.constexpr = False,  # y = silu(gate) * up of the weight's two halves [N/2]
    SPLITS: tl.constexpr = 1,  # programs a row's columns are shared among (`_combine`)
    MAX_SPLITS: tl.constexpr = 1,  # (the tuning key: the most SPLITS a product may take)
    FOLD: tl.constexpr = False,  # (BITS 8) a sum a row and run of a thread's columns (`_fold`)
):
    rows, row_ok = _rows(N, BLOCK_N, SWIGLU)
    stored: tl.constexpr = K // 2 if BITS == 4 else K  # columns a row stores
    span: tl.constexpr = stored // SPLITS  # columns a program reads, from `begin`
    begin = _split_begin(span, SPLITS)
    run: tl.constexpr = 16 if FOLD else 1  # columns a sum covers (`_fold`)
    acc = tl.zeros([BLOCK_N, BLOCK_K // run], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)  # of x (NORM)
    biased: tl.constexpr = INT8_BIASED and BITS == 8 and GROUP == K
    sums = tl.zeros([BLOCK_K], dtype=tl.float32)  # of the product's input (biased)
    # No kernel of the step writes the weights: their first tiles may come before the wait.
    first: tl.constexpr = PRELOAD >= 1
    second: tl.constexpr = PRELOAD >= 2 and span // BLOCK_K >= 2
    if first:
        w0 = _weights(w_ptr, rows, row_ok, stored, begin, BLOCK_K)
    if second:
        w1 = _weights(w_ptr, rows, row_ok, stored, begin + BLOCK_K, BLOCK_K)
    wait_for_previous(EARLY)
    if first:
        acc, squares, sums = _accumulate(
            acc, squares, sums, w0, begin, x_ptr, scale_ptr, zero_ptr, norm_ptr, rows, row_ok, K,
            GROUP, BITS, NORM, GATED, BLOCK_K, X_TILE, INT4_FROM_BITS, biased, run,
        )  # fmt: skip
    if second:
        acc, squares, sums = _accumulate(
            acc, squares, sums, w1, begin + BLOCK_K, x_ptr, scale_ptr, zero_ptr, norm_ptr, rows,
            row_ok, K, GROUP, BITS, NORM, GATED, BLOCK_K, X_TILE, INT4_FROM_BITS, biased, run,
        )  # fmt: skip
    for k0 in range(begin + (first + second) * BLOCK_K, begin + span, BLOCK_K):
        w = _weights(w_ptr, rows, row_ok, stored, k0, BLOCK_K)
        acc, squares, sums = _accumulate(
            acc, squares, sums, w, k0, x_ptr, scale_ptr, zero_ptr, norm_ptr, rows, row_ok, K, GROUP,
            BITS, NORM, GATED, BLOCK_K, X_TILE, INT4_FROM_BITS, biased, run,
        )  # fmt: skip
    groups = K // GROUP
    y = tl.sum(acc, axis=1)
    if biased:  # sum (1 + (q + 128) / 2^15) x = sum q x / 2^15 + (1 + 128 / 2^15) sum x
        y = y * 32768.0 - 32896.0 * tl.sum(sums, axis=0)
    if NORM:  # the norm's 1 / rms scales the whole product: applied once, at the end
        y *= 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    if BITS == 8 and groups == 1:
        y *= tl.load(scale_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    _finish(y, y_ptr, residual_ptr, partial_ptr, count_ptr, rows, row_ok, N, BLOCK_N, RESIDUAL,
            SWIGLU, SPLITS)  # fmt: skip


@triton.jit
def _split_begin(span: tl.constexpr, SPLITS: tl.constexpr):
    """Where this program's share of a row starts (in the units `span` counts)."""
    if SPLITS > 1:
        return tl.program_id(1) * span
    return 0


@triton.jit
def _finish(
    y, y_ptr, residual_ptr, partial_ptr, count_ptr, rows, row_ok, N, BLOCK_N: tl.constexpr,
    RESIDUAL, SWIGLU, SPLITS: tl.constexpr,
):  # fmt: skip
    """`_store` y, once a row block's SPLITS programs have all summed their columns."""
    if SPLITS > 1:
        y, last = _combine(y, partial_ptr, count_ptr, rows, row_ok, N, SPLITS)
        if last:
            _store(y, y_ptr, residual_ptr, rows, row_ok, N, BLOCK_N, RESIDUAL, SWIGLU)
    else:
        _store(y, y_ptr, residual_ptr, rows, row_ok, N, BLOCK_N, RESIDUAL, SWIGLU)


@triton.jit
def _combine(y, partial_ptr, count_ptr, rows, row_ok, N, SPLITS: tl.constexpr):
    """Split-K without a second kernel: each of a row block's programs stores its sums, then
    counts itself done (an atomic that publishes the stores); the last one adds the SPLITS sums
    in order (the same sum whichever finishes last) and sets the count back to 0 for the next
    launch. Returns (the sum, whether this program is the last)."""
    block = tl.program_id(0)
    tl.store(partial_ptr + tl.program_id(1) * N + rows, y, mask=row_ok)
    tl.debug_barrier()  # every thread's sums stored before the count
    done = tl.atomic_add(count_ptr + block, 1, sem="acq_rel")
    last = done == SPLITS - 1
    total = tl.zeros_like(y)
    if last:
        for split in tl.static_range(SPLITS):
            at = partial_ptr + split * N + rows
            total += tl.load(at, mask=row_ok, other=0, cache_modifier=".cg")  # (L2, not L1)
        tl.store(count_ptr + block, 0)
    return total, last


@triton.jit
def _rows(N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """A program's weight rows and which exist. SWIGLU: pairs (gate i, up i), rows i and N/2 + i
    side by side, for BLOCK_N / 2 outputs i."""
    if SWIGLU:
        at = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        return at + (tl.arange(0, BLOCK_N) % 2) * (N // 2), at < N // 2
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < N


@triton.jit
def _store(y, y_ptr, residual_ptr, rows, row_ok, N, BLOCK_N: tl.constexpr, RESIDUAL, SWIGLU):
    """y [BLOCK_N] (fp32) out, rounded as the unfused block rounds: the product, then the
    residual's sum (RESIDUAL); the gate and up, silu(gate), then its product with up (SWIGLU)."""
    dtype = y_ptr.dtype.element_ty
    if SWIGLU:
        gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), [BLOCK_N // 2, 2]))
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        at = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + at, (silu * up).to(dtype), mask=at < N // 2)
    else:
        if RESIDUAL:
            residual = tl.load(residual_ptr + rows, mask=row_ok, other=0).to(tl.float32)
            y = y.to(dtype).to(tl.float32) + residual
        tl.store(y_ptr + rows, y.to(dtype), mask=row_ok)


@triton.jit
def _weights(w_ptr, rows, row_ok, stored, k0, BLOCK_K: tl.constexpr):
    """The weight tile [rows, k0:k0 + BLOCK_K] as stored."""
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(
        w_ptr + rows[:, None] * stored + cols[None, :],
        mask=row_ok[:, None],
        other=0,
        eviction_policy="evict_first",  # read once; x stays cached
    )


@triton.jit
def _accumulate(
    acc, squares, sums, w, k0, x_ptr, scale_ptr, zero_ptr, norm_ptr, rows, row_ok, K, GROUP,
    BITS, NORM, GATED, BLOCK_K: tl.constexpr, X_TILE: tl.constexpr,
    INT4_FROM_BITS: tl.constexpr, BIASED: tl.constexpr, run: tl.constexpr,
):  # fmt: skip
    """acc + the weight tile w (stored columns k0..) times its inputs, `squares` + x^2 (NORM)
    and `sums` + x (BIASED)."""
    stored = K // 2 if BITS == 4 else K
    groups = K // GROUP
    cols = k0 + tl.arange(0, BLOCK_K)
    x, squares = _input(x_ptr, norm_ptr, cols, rows, K, squares, NORM, GATED, X_TILE)
    if BIASED:
        sums += _input_row(x, x_ptr, norm_ptr, cols, NORM, X_TILE)
        acc += _fold(_int8_biased(w) * x, run)
    elif BITS == 16:
        acc += _fold(w.to(tl.float32) * x, run)
    elif BITS == 8 and groups == 1:  # one scale a row: applied at the end
        acc += _fold(_int8_values(w) * x, run)
    elif BITS == 8:
        scale = tl.load(scale_ptr + rows * groups + k0 // GROUP, mask=row_ok, other=0)
        acc += _fold(_int8_values(w) * scale.to(tl.float32)[:, None] * x, run)
    else:
        high_cols = stored + cols
        x_high, squares = _input(x_ptr, norm_ptr, high_cols, rows, K, squares, NORM, GATED, X_TILE)
        low = rows * groups + k0 // GROUP
        high = rows * groups + (stored + k0) // GROUP
        if INT4_FROM_BITS:
            low_values, high_values = _int4_values(w)
            acc += _int4_times(low_values, 2.0, 264.0, x, scale_ptr, zero_ptr, low, row_ok)
            acc += _int4_times(high_values, 0.125, 24.0, x_high, scale_ptr, zero_ptr, high, row_ok)
        else:  # the converter: v = n, one step a unit, offset 8
            low_values, high_values = (w & 0xF).to(tl.float32), (w >> 4).to(tl.float32)
            acc += _int4_times(low_values, 1.0, 8.0, x, scale_ptr, zero_ptr, low, row_ok)
            acc += _int4_times(high_values, 1.0, 8.0, x_high, scale_ptr, zero_ptr, high, row_ok)
    return acc, squares, sums


@triton.jit
def _fold(products, RUN: tl.constexpr):
    """products [rows, cols] summed over each run of RUN columns (an int8 thread's 16-byte
    load) -> [rows, cols / RUN]: with fp contraction, a chain of FMAs a row and thread, so a
    thread keeps a sum a row instead of one a column, and may hold more rows (`_ROW_DEEP`)."""
    if RUN == 1:
        return products
    rows: tl.constexpr = products.shape[0]
    cols: tl.constexpr = products.shape[1]
    return tl.sum(tl.reshape(products, [rows, cols // RUN, RUN]), axis=2)


@triton.jit
def _input_row(x, x_ptr, norm_ptr, cols, NORM, X_TILE: tl.constexpr):
    """The product's input at `cols` as a vector, given `_input`'s x: as a vector, x's only
    row; as a tile, loaded again (summing the tile would cost an add a weight)."""
    if X_TILE:
        row = tl.load(x_ptr + cols).to(tl.float32)
        if NORM:
            row *= tl.load(norm_ptr + cols).to(tl.float32)
        return row
    return tl.sum(x, axis=0)  # x is [1, BLOCK_K]: its row


@triton.jit
def _input(x_ptr, norm_ptr, cols, rows, K, squares, NORM, GATED, X_TILE: tl.constexpr):
    """The product's input at `cols`, broadcastable to the weight tile, and `squares` (NORM).

    X_TILE: x is loaded as a [rows, cols] tile, in the weight tile's own layout. Loaded as a
    vector, x takes another layout and is exchanged through shared memory on every step of
    the loop, behind barriers (2 a step for bf16, 8 for int8 at 8 x 1024 on sm_90, read off the
    compiled code); as a tile each thread loads the x its weights need, from L1. The norm's
    sum of squares still reads x as a vector (it never meets the tile until the end)."""
    if X_TILE:  # (one return: the compiler wants every return of one type)
        at = cols[None, :] + 0 * rows[:, None]
        x = tl.load(x_ptr + at).to(tl.float32)
        if NORM:
            x_row = tl.load(x_ptr + cols).to(tl.float32)
            squares += x_row * x_row
            x *= tl.load(norm_ptr + at).to(tl.float32)
    else:
        x, squares = _activation(x_ptr, norm_ptr, cols, K, squares, NORM, GATED)
        x = x[None, :]
    return x, squares


@triton.jit
def _activation(x_ptr, norm_ptr, cols, K, squares, NORM: tl.constexpr, GATED: tl.constexpr):
    """(the product's input at `cols` in fp32, `squares` + x^2 there when NORM). GATED: silu(gate)
    * up, rounded where the unfused block rounds; NORM: x times the norm's weight (the 1 / rms
    factor comes at the end, so the GEMV reads x once)."""
    dtype = x_ptr.dtype.element_ty
    if GATED:
        gate = tl.load(x_ptr + cols).to(tl.float32)
        up = tl.load(x_ptr + K + cols).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        return (silu * up).to(dtype).to(tl.float32), squares
    x = tl.load(x_ptr + cols).to(tl.float32)
    if NORM:
        return x * tl.load(norm_ptr + cols).to(tl.float32), squares + x * x
    return x, squares


def _int8_asm(selectors: tuple[str, ...], subtract: str | None, signed: bool) -> str:
    """PTX making four fp32 $0-$3 from the four bytes q + 128 of $4 (`signed`: the bytes are
    int8 q; one xor makes all four q + 128), each set by a byte permute (its selector) into a
    float's pattern, then `subtract` taken off each (None: none)."""
    biased = "biased" if signed else "$4"
    lines = [".reg .b32 biased;", "xor.b32 biased, $4, 0x80808080;"] if signed else []
    pattern = "0x4B000000" if subtract else "0x3F800000"
    for i, selector in enumerate(selectors):
        lines.append(f"prmt.b32 ${i}, {biased}, {pattern}, {selector};")
    if subtract:
        lines += [f"sub.f32 ${i}, ${i}, {subtract};" for i in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


_VALUES = ("0x7540", "0x7541", "0x7542", "0x7543"), "0f4B000080"  # into 0x4B0000__, - (2^23 + 128)
_INT8_VALUES_ASM = tl.constexpr(_int8_asm(*_VALUES, signed=False))
_INT8_VALUES_ASM_SIGNED = tl.constexpr(_int8_asm(*_VALUES, signed=True))
_BIASED = ("0x7604", "0x7614", "0x7624", "0x7634"), None  # into 0x3F80__00
_INT8_BIASED_ASM = tl.constexpr(_int8_asm(*_BIASED, signed=False))
_INT8_BIASED_ASM_SIGNED = tl.constexpr(_int8_asm(*_BIASED, signed=True))


@triton.jit
def _offset_bytes(q):
    """int8 q [rows, cols] as uint32 q + 128: from int8 one xor; uint8 holds q + 128 already
    (`QuantizedLinear`'s copy: the xor done once, when the weights are converted)."""
    if q.dtype == tl.uint8:
        return q.to(tl.uint32)
    return q.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x80


@triton.jit
def _int8_values(q):
    """int8 [rows, cols] (or uint8 q + 128: `_offset_bytes`) as exact fp32 without the
    integer-to-float converter (a quarter of the FMA rate): as bits, 2^23 + 128 + q is
    0x4B000000 | (q + 128). Four at a time from the register that holds them: a byte permute
    sets each q + 128 into 0x4B0000__, a subtraction leaves q; 2 instructions a weight (2.25
    with the xor that makes int8 bytes q + 128), where Triton's own code for the same
    arithmetic spent 3 (a byte extract, an xor, a subtraction). Compiled for sm_90, 1B w13's
    kernel with its norm went from 7.49 to 6.77 instructions a weight, w2's with SiLU·up from
    7.34 to 6.62 (SASS counted over a program's rows, with the xor; docs/benchmarks.md). The
    interpreter runs no PTX: there, the same in Triton."""
    if not ASSEMBLY:
        bits = _offset_bytes(q) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    return _permuted(q, _INT8_VALUES_ASM, _INT8_VALUES_ASM_SIGNED)


@triton.jit
def _int8_biased(q):
    """int8 [rows, cols] (or uint8 q + 128: `_offset_bytes`) as fp32 1 + (q + 128) / 2^15,
    exactly, from their bits: 0x3F80__00 with q + 128 in the second byte. Four at a time from
    the register that holds them: one byte permute each sets q + 128 into 1.0's pattern, 1
    instruction a weight (1.25 with the xor that makes int8 bytes q + 128). The product's sum
    takes the bias off at the end (`_gemv`): the terms carry ~2^8 times their size in x, so the
    fp32 sums keep ~15 of their 24 bits, to a bf16 output's 8. The interpreter runs no PTX:
    there, the same in Triton."""
    if not ASSEMBLY:
        return ((_offset_bytes(q) << 8) | 0x3F800000).to(tl.float32, bitcast=True)
    return _permuted(q, _INT8_BIASED_ASM, _INT8_BIASED_ASM_SIGNED)


@triton.jit
def _permuted(q, OFFSET_ASM: tl.constexpr, SIGNED_ASM: tl.constexpr):
    """fp32 from q's bytes, four a register, by `_int8_asm`'s PTX: OFFSET_ASM for uint8 q + 128,
    SIGNED_ASM (its xor first) for int8 q."""
    asm: tl.constexpr = OFFSET_ASM if q.dtype == tl.uint8 else SIGNED_ASM
    return tl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r", [q], dtype=tl.float32, is_pure=True, pack=4
    )


@triton.jit
def _int4_values(q):
    """Both nibbles of uint8 [rows, cols] as exact fp32, without the converter: a byte moved to
    bits 15-22 and masked into 0x43000000 (128.0) gives 128 + n / 2 for its low nibble n (bits
    15-18) and 128 + 8 n for its high one (bits 19-22). Four bytes a register: four shifts and
    eight LOP3s, 1.5 instructions a weight (`_int4_times` undoes the offsets and scales). The
    interpreter runs no PTX: there, the same in Triton."""
    if not ASSEMBLY:
        moved = q.to(tl.uint32) << 15
        low = (moved & 0x00078000) | 0x43000000
        high = (moved & 0x00780000) | 0x43000000
        return low.to(tl.float32, bitcast=True), high.to(tl.float32, bitcast=True)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 b0, b1, b2, b3;
        shl.b32 b0, $8, 15;
        shl.b32 b1, $8, 7;
        shr.b32 b2, $8, 1;
        shr.b32 b3, $8, 9;
        lop3.b32 $0, b0, 0x00078000, 0x43000000, 0xEA;
        lop3.b32 $1, b1, 0x00078000, 0x43000000, 0xEA;
        lop3.b32 $2, b2, 0x00078000, 0x43000000, 0xEA;
        lop3.b32 $3, b3, 0x00078000, 0x43000000, 0xEA;
        lop3.b32 $4, b0, 0x00780000, 0x43000000, 0xEA;
        lop3.b32 $5, b1, 0x00780000, 0x43000000, 0xEA;
        lop3.b32 $6, b2, 0x00780000, 0x43000000, 0xEA;
        lop3.b32 $7, b3, 0x00780000, 0x43000000, 0xEA;
        }""",
        "=r,=r,=r,=r,=r,=r,=r,=r,r",
        [q],
        dtype=(tl.float32, tl.float32),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _int4_times(v, per_step, offset, x, scale_ptr, zero_ptr, at, row_ok):
    """((n - 8) * scale + zero) * x for a tile of int4 values n within one group per row, given
    as floats v = base + n / per_step: n - 8 = v * per_step - offset, `offset` = base *
    per_step + 8, so w = v * (per_step * scale) + (zero - offset * scale). From the converter v
    = n (1, 8); from `_int4_values` 128 + n / 2 (2, 264) and 128 + 8 n (1/8, 24). The product
    v * a is exact in the FMA; `offset * scale` rounds at 2^-24 of itself. (The converter
    measured faster than `_int8_values`' bit trick here: 1B w13 15.7 against 18.4 us, H200.)"""
    scale = tl.load(scale_ptr + at, mask=row_ok, other=0).to(tl.float32)
    zero = tl.load(zero_ptr + at, mask=row_ok, other=0).to(tl.float32)
    return (v * (per_step * scale)[:, None] + (zero - offset * scale)[:, None]) * x


# int4 products of one row in packed half-precision arithmetic (`_gemv_int4`): the GEMV's int4
# path spends 7.4-10.5 instructions a weight (sm_90 SASS), too many for the weights' bandwidth.
# False: int4 takes `_gemv` (the A/B in benchmarks/decode.py, variant lmforge-int4-bytes).
INT4_HALVES = True
# x enters the packed products as fp16(x * 2^-shift): a lane's two products of |n - 8| <= 8 stay
# below fp16's largest value (65,504) for |x| up to 2^11 * 2^shift, and x down to 2^-14 *
# 2^shift keeps fp16's 11 bits. The scales put 2^shift back, in fp32.
_X_SHIFT = 4
_X_SHIFT_GATED = 8  # silu(gate) * up: Llama's largest activations are here


@triton.jit
def _gemv_int4(
    x_ptr,  # [K] activations; [2K] (gate, up) when GATED
    w_ptr,  # [N, K/8] int32: the int4 layout's bytes four to a word
    scale_ptr,  # [N, groups]
    zero_ptr,  # [N, groups]
    norm_ptr,  # [K] RMSNorm weight (NORM)
    residual_ptr,  # [N] (RESIDUAL)
    y_ptr,  # [N]
    partial_ptr,  # [SPLITS, N] fp32 (SPLITS > 1), as in `_gemv`
    count_ptr,  # [N] int32 zeros (SPLITS > 1)
    N,
    K: tl.constexpr,
    eps,
    GROUP: tl.constexpr,  # columns a scale covers
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,  # groups of low nibbles a tile reads (and as many of high ones)
    EARLY: tl.constexpr,
    PRELOAD: tl.constexpr,  # (EARLY) 0 or 1 weight tile loaded before the wait
    DOWN: tl.constexpr,  # x enters the half-precision products as x * DOWN (2^-shift)
    UP: tl.constexpr,  # 1 / DOWN, with the scales
    SWIGLU: tl.constexpr = False,  # y = silu(gate) * up of the weight's two halves [N/2]
    SPLITS: tl.constexpr = 1,  # programs a row's groups are shared among (`_combine`)
    MAX_SPLITS: tl.constexpr = 1,  # (the tuning key)
):
    """`_gemv` for int4 (bits 4, the module docstring's layout), a row's bytes read four to an
    int32 word: word c holds the low nibbles of columns 4c..4c+3 and the high nibbles of
    K/2 + 4c..4c+3. A tile is [BLOCK_N rows, GROUPS groups, GROUP / 4 words]: each low group
    comes with the high group K/2 columns on; `_int4_words_times` sums four words of a row in
    packed fp16 and applies their group's scale in fp32, the zeros go in through x's sums."""
    rows, row_ok = _rows(N, BLOCK_N, SWIGLU)
    words: tl.constexpr = GROUP // 4  # a group's low nibbles
    halves: tl.constexpr = K // 2 // GROUP  # the high nibbles' groups start here
    acc = tl.zeros([BLOCK_N, GROUPS, words], dtype=tl.float32)
    zeros = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)  # sum over groups of zero * sum x
    squares = tl.zeros([GROUPS, words], dtype=tl.float32)
    span: tl.constexpr = halves // SPLITS  # groups a program reads, from `begin`
    begin = _split_begin(span, SPLITS)
    if PRELOAD >= 1:  # no kernel of the step writes the weights: they may come before the wait
        w0 = _int4_words(w_ptr, rows, row_ok, K, begin, GROUPS, words)
    wait_for_previous(EARLY)
    if PRELOAD >= 1:
        acc, zeros, squares = _int4_accumulate(
            acc, zeros, squares, w0, begin, x_ptr, scale_ptr, zero_ptr, norm_ptr, rows, row_ok, K,
            GROUP, NORM, GATED, GROUPS, words, halves, DOWN, UP,
        )  # fmt: skip
    for g0 in range(begin + PRELOAD * GROUPS, begin + span, GROUPS):
        w = _int4_words(w_ptr, rows, row_ok, K, g0, GROUPS, words)
        acc, zeros, squares = _int4_accumulate(
            acc, zeros, squares, w, g0, x_ptr, scale_ptr, zero_ptr, norm_ptr, rows, row_ok, K,
            GROUP, NORM, GATED, GROUPS, words, halves, DOWN, UP,
        )  # fmt: skip
    y = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(zeros, axis=1)
    if NORM:
        y *= 1.0 / tl.sqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / K + eps)
    _finish(y, y_ptr, residual_ptr, partial_ptr, count_ptr, rows, row_ok, N, BLOCK_N, RESIDUAL,
            SWIGLU, SPLITS)  # fmt: skip


@triton.jit
def _int4_words(w_ptr, rows, row_ok, K, g0, GROUPS: tl.constexpr, words: tl.constexpr):
    """The word tile [rows, groups g0.., a group's words] as stored."""
    at = (g0 + tl.arange(0, GROUPS))[:, None] * words + tl.arange(0, words)[None, :]
    return tl.load(
        w_ptr + rows[:, None, None] * (K // 8) + at[None, :, :],
        mask=row_ok[:, None, None],
        other=0,
        eviction_policy="evict_first",
    )


@triton.jit
def _int4_accumulate(
    acc, zeros, squares, w, g0, x_ptr, scale_ptr, zero_ptr, norm_ptr, rows, row_ok, K, GROUP,
    NORM, GATED, GROUPS: tl.constexpr, words: tl.constexpr, halves: tl.constexpr, DOWN, UP,
):  # fmt: skip
    """acc + the word tile w (low groups g0.., high ones halves + g0..) times its inputs; the
    zeros' terms into `zeros`, x^2 into `squares` (NORM)."""
    low0 = 4 * ((g0 + tl.arange(0, GROUPS))[:, None] * words + tl.arange(0, words)[None, :])
    high0 = low0 + K // 2
    # x at the low columns 4c + j (x0..x3) and the high ones K/2 + 4c + j (h0..h3): [GROUPS, words]
    x0, squares = _activation(x_ptr, norm_ptr, low0, K, squares, NORM, GATED)
    x1, squares = _activation(x_ptr, norm_ptr, low0 + 1, K, squares, NORM, GATED)
    x2, squares = _activation(x_ptr, norm_ptr, low0 + 2, K, squares, NORM, GATED)
    x3, squares = _activation(x_ptr, norm_ptr, low0 + 3, K, squares, NORM, GATED)
    h0, squares = _activation(x_ptr, norm_ptr, high0, K, squares, NORM, GATED)
    h1, squares = _activation(x_ptr, norm_ptr, high0 + 1, K, squares, NORM, GATED)
    h2, squares = _activation(x_ptr, norm_ptr, high0 + 2, K, squares, NORM, GATED)
    h3, squares = _activation(x_ptr, norm_ptr, high0 + 3, K, squares, NORM, GATED)
    groups: tl.constexpr = K // GROUP
    low = rows[:, None] * groups + (g0 + tl.arange(0, GROUPS))[None, :]  # [BLOCK_N, GROUPS]
    scale_low = tl.load(scale_ptr + low, mask=row_ok[:, None], other=0).to(tl.float32) * UP
    scale_high = tl.load(scale_ptr + low + halves, mask=row_ok[:, None], other=0).to(tl.float32)
    acc = _int4_words_times(
        acc,
        w,
        _half_pair(x0 * DOWN, x2 * DOWN)[None, :, :],  # the pairs a word's nibbles make
        _half_pair(x1 * DOWN, x3 * DOWN)[None, :, :],
        _half_pair(h0 * DOWN, h2 * DOWN)[None, :, :],
        _half_pair(h1 * DOWN, h3 * DOWN)[None, :, :],
        scale_low[:, :, None],
        (scale_high * UP)[:, :, None],
    )
    zero_low = tl.load(zero_ptr + low, mask=row_ok[:, None], other=0).to(tl.float32)
    zero_high = tl.load(zero_ptr + low + halves, mask=row_ok[:, None], other=0).to(tl.float32)
    x_low = tl.sum(x0 + x1 + x2 + x3, axis=1)  # [GROUPS]: a group's x, for its zero
    x_high = tl.sum(h0 + h1 + h2 + h3, axis=1)
    zeros += zero_low * x_low[None, :] + zero_high * x_high[None, :]
    return acc, zeros, squares


@triton.jit
def _half_pair(low, high):
    """fp32 tensors as one int32 each: fp16(low) in the low half, fp16(high) in the high one."""
    if not ASSEMBLY:
        bits_low = low.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits_high = high.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16
        return bits_low | bits_high
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [low, high], dtype=tl.int32, is_pure=True, pack=1
    )


def _int4_asm() -> str:
    """`_int4_words_times`' PTX: four words of a row within one group, $8-$11, with their x
    pairs $12-$27, scales $28 (low) and $32 (high), added to acc $4 (acc $5-$7 pass)."""
    lines = [
        ".reg .b32 w8, l02, l13, h02, h13, dl, dh, c1032, c16th, c72;",
        ".reg .b16 lo, hi;",
        ".reg .f32 flo, fhi, sum;",
        "mov.b32 c1032, 0x64086408;",  # 1032.0 twice: 1024 + n - 1032 = n - 8
        "mov.b32 c16th, 0x2C002C00;",  # 1/16 twice
        "mov.b32 c72, 0xD480D480;",  # -72.0 twice: (1024 + 16 n) / 16 - 72 = n - 8
        "mov.b32 dl, 0;",
        "mov.b32 dh, 0;",
    ]
    for i in range(4):
        w, a, b, c, d = (f"${8 + 4 * j + i}" for j in range(5))
        lines += [
            f"shr.b32 w8, {w}, 8;",
            f"lop3.b32 l02, {w}, 0x000F000F, 0x64006400, 0xEA;",  # (w & mask) | 1024.0's bits
            f"lop3.b32 h02, {w}, 0x00F000F0, 0x64006400, 0xEA;",
            "lop3.b32 l13, w8, 0x000F000F, 0x64006400, 0xEA;",
            "lop3.b32 h13, w8, 0x00F000F0, 0x64006400, 0xEA;",
            "sub.rn.f16x2 l02, l02, c1032;",
            "sub.rn.f16x2 l13, l13, c1032;",
            "fma.rn.f16x2 h02, h02, c16th, c72;",
            "fma.rn.f16x2 h13, h13, c16th, c72;",
            f"fma.rn.f16x2 dl, l02, {a}, dl;",
            f"fma.rn.f16x2 dl, l13, {b}, dl;",
            f"fma.rn.f16x2 dh, h02, {c}, dh;",
            f"fma.rn.f16x2 dh, h13, {d}, dh;",
        ]
    for lanes, scale, into in (("dl", "$28", "$4"), ("dh", "$32", "$0")):
        lines += [
            f"mov.b32 {{lo, hi}}, {lanes};",
            "cvt.f32.f16 flo, lo;",
            "cvt.f32.f16 fhi, hi;",
            "add.f32 sum, flo, fhi;",
            f"fma.rn.f32 $0, sum, {scale}, {into};",
        ]
    lines += ["mov.b32 $1, $5;", "mov.b32 $2, $6;", "mov.b32 $3, $7;"]
    return "{\n" + "\n".join(lines) + "\n}"


_INT4_ASM = tl.constexpr(_int4_asm())
_INT4_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 32))  # 4 out, 32 in


@triton.jit
def _int4_words_times(acc, w, a, b, c, d, scale_low, scale_high):
    """acc + (n - 8) x summed over words w [rows, groups, words] (low nibbles times scale_low,
    high ones times scale_high), x given as fp16 pairs (`_half_pair`): a = (x[4c], x[4c+2]), b
    = (x[4c+1], x[4c+3]), c and d the same K/2 on. Each nibble becomes an fp16 from its bits:
    masked into 1024.0's pattern, two a register (one LOP3 for two), a low nibble is 1024 + n
    and a high one 1024 + 16 n; one packed subtraction or FMA makes each pair n - 8 exactly.
    Packed FMAs sum four consecutive words of a row (one group: one scale) in two fp16 lanes,
    which go to fp32 once: ~16 instructions for 8 weights, where `_int4_values` and fp32 FMAs
    take 2.5 a weight. The interpreter runs no PTX: there, the same arithmetic in Triton (fp16
    products, rounded to fp16 where the PTX rounds them, words summed in fp32)."""
    if not ASSEMBLY:
        low = _nibble_dots(w, 0, _unpaired(a, b))
        high = _nibble_dots(w, 4, _unpaired(c, d))
        return acc + low * scale_low + high * scale_high
    return tl.inline_asm_elementwise(
        _INT4_ASM,
        _INT4_CONSTRAINTS,
        [acc, w, a, b, c, d, scale_low, scale_high],
        dtype=tl.float32,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _unpaired(a, b):
    """The interpreter's x for one word's nibbles, in their order in the word: (x[4c], x[4c+2]),
    (x[4c+1], x[4c+3]) as four fp32 (fp16 values)."""
    return (_half(a), _half(b), _half(a >> 16), _half(b >> 16))


@triton.jit
def _half(bits):
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble_dots(w, shift, xs):
    """The interpreter's half of `_int4_words_times` for one word: the nibbles of bytes 0 and 1
    make one lane, (n0 x0) rounded to fp16, + n1 x1, rounded again; bytes 2 and 3 the other;
    the lanes added in fp32."""
    x0, x1, x2, x3 = xs
    n0 = ((w >> shift) & 0xF).to(tl.float32) - 8  # byte 0: x[4c]
    n1 = ((w >> (shift + 8)) & 0xF).to(tl.float32) - 8  # byte 1: x[4c+1]
    n2 = ((w >> (shift + 16)) & 0xF).to(tl.float32) - 8  # byte 2: x[4c+2]
    n3 = ((w >> (shift + 24)) & 0xF).to(tl.float32) - 8  # byte 3: x[4c+3]
    lane_a = ((n0 * x0).to(tl.float16).to(tl.float32) + n1 * x1).to(tl.float16)
    lane_b = ((n2 * x2).to(tl.float16).to(tl.float32) + n3 * x3).to(tl.float16)
    return lane_a.to(tl.float32) + lane_b.to(tl.float32)


@triton.jit
def _dequantize(
    w_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,  # [N, K] bf16
    N,
    K,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    stored = K // 2 if BITS == 4 else K
    ok = (rows < N)[:, None] & (cols < stored)[None, :]
    groups = K // GROUP
    q = tl.load(w_ptr + rows[:, None] * stored + cols[None, :], mask=ok, other=0)
    at = rows[:, None] * groups + cols[None, :] // GROUP
    out = out_ptr + rows[:, None] * K + cols[None, :]
    if BITS == 8:
        scale = tl.load(scale_ptr + at, mask=ok, other=0).to(tl.float32)
        values = (_offset_bytes(q).to(tl.int32) - 128).to(tl.float32)  # int8 or uint8 q + 128
        tl.store(out, (values * scale).to(out_ptr.dtype.element_ty), mask=ok)
    else:  # the low nibbles are columns 0..K/2-1, the high ones K/2..K-1
        _store_int4(q & 0xF, scale_ptr, zero_ptr, at, out, ok)
        _store_int4(q >> 4, scale_ptr, zero_ptr, at + stored // GROUP, out + stored, ok)


@triton.jit
def _store_int4(q, scale_ptr, zero_ptr, at, out, ok):
    scale = tl.load(scale_ptr + at, mask=ok, other=0).to(tl.float32)
    zero = tl.load(zero_ptr + at, mask=ok, other=0).to(tl.float32)
    w = (q.to(tl.float32) - 8) * scale + zero
    tl.store(out, w.to(out.dtype.element_ty), mask=ok)


# (BLOCK_N, num_warps, num_stages) the autotuner tries at a tile width: the winners over the 1B
# and 3B presets' shapes on an H200 out of 2-16 rows × 4 or 8 warps × 1 or 3 stages (2026-12-01,
# docs/benchmarks.md), so that a model tunes in seconds. Where one scale covers a row, at the
# widest width that divides it and at half that width; where scales are grouped, at the group.
_ROW_WIDE = [(2, 4, 1), (2, 4, 3), (4, 8, 1), (8, 8, 3)]
_ROW_HALF = [(4, 4, 3), (8, 8, 3)]
_GROUPED = [(16, 8, 3), (8, 8, 1), (8, 8, 3), (4, 4, 3)]
# Where the product takes a norm or SiLU·up (one scale a row), also 8 rows a program with 4
# warps: the best in a search over 2-32 rows, 512-2048 columns, 4/8 warps, 1/3 stages, x as
# tile or vector (benchmarks/gemv_search.py on an H200, 2026-12-02, weights warm in L2: 1B w13
# with its norm 18.45 us against 19.66 for the plain products' tiles). Tried alone in the
# engine, bf16's products took 0.782 ms of the 1B step instead of 0.803, but int8 decoded 11%
# slower (1,085 against 1,217 tok/s): the autotuner, which flushes L2, picks among both sets.
_FUSED_WIDE = [(8, 4, 3), (8, 8, 3), (4, 4, 3)]
_FUSED_HALF = [(8, 4, 3), (8, 8, 3)]
# int8 of one scale a row, folded (`_fold`; config FOLD is set on these shapes only, none of
# which is in the lists above): fewer warps for the rows, so a thread holds 4-16 of them and
# loads and converts each x it needs once for all (a warp spans 512 columns at 16 bytes a
# thread, so at 1024 columns two warps share a row's width). Session 22's count (sm_90): the
# 1B's int8 w2 at 2 rows a program spends 6.6 instructions a weight (Nsight Compute), one x
# conversion a weight among them.
_ROW_DEEP = [(8, 2, 3), (16, 4, 3), (16, 2, 3), (32, 4, 3), (8, 2, 1), (16, 4, 1)]

MIN_TILE = 16  # the narrowest K tile: a row (and a group) must be a multiple of it
_WIDTHS = (1024, 512, 256, 128, 64, 32, MIN_TILE)


# Split-K (`_combine`): a product without a norm or SiLU·up may share each row's columns among
# 2 or 4 programs, tuned like a tile (pinned as `... kSPLITS`). Long rows over few rows (w2:
# 8,192 columns, 2,048 rows on the 1B) otherwise leave one program an SM reading one tile at a
# time. On an H200 (2026-12-02, docs/benchmarks.md) the autotuner split the int4 1B's w2 in 4
# and the 3B's wo in 2, and int4 decoded 3.4% (1B) and 3.0% (3B) faster; bf16 and int8 kept
# whole rows. False: never (benchmarks/decode.py, variant lmforge-no-split).
SPLIT_K = True
# int8 products of one scale a row may take folded sums (`_fold`) and the deep tiles
# (`_ROW_DEEP`), chosen like a tile. False: neither is a candidate.
FOLD = True
SPLIT_COUNTS = (1, 2, 4)


def _gemv_configs() -> list[triton.Config]:
    shapes = {*_ROW_WIDE, *_ROW_HALF, *_GROUPED, *_FUSED_WIDE, *_FUSED_HALF, *_ROW_DEEP}
    return [
        triton.Config(
            {
                "BLOCK_N": n,
                "BLOCK_K": k,
                "X_TILE": tile,
                "INT8_BIASED": biased,
                "SPLITS": splits,
                "FOLD": fold,
            },
            num_warps=w,
            num_stages=s,
        )
        for k in _WIDTHS
        for n, w, s in sorted(shapes)
        for tile in (False, True)
        for biased in (False, True)
        for splits in SPLIT_COUNTS
        for fold in [(n, w, s) in _ROW_DEEP]  # the deep tiles are the folded ones
    ]


def _tile_width(k: int, group: int, bits: int) -> int:
    """The widest tile (stored columns) that divides a row and lies within a scale's group."""
    stored = k // 2 if bits == 4 else k
    span = stored if group >= k else group  # columns one scale covers
    return next(w for w in _WIDTHS if span % w == 0)


def _candidates(configs, args: dict) -> list:
    """The configs to try for one product (see `_ROW_WIDE`): tiles that divide a row and, where
    scales are grouped, lie within a group; x as a vector and as a tile (`_input`; a gated
    input only as a vector: as a tile, every row of a program would recompute its SiLU).
    On an H200 (2026-12-02) the autotuner chose x as a tile for 12 of the 24 products it
    tuned in benchmarks/gemv.py (1B and 3B; bf16, int8, int4) and as a vector for 12: both
    stay. int8 of one scale a row, also biased (`INT8_BIASED`)."""
    k, group = args["K"], args["GROUP"]
    biased = {False, int8_biased(args["BITS"], group, k, args["x_ptr"].dtype)}
    width = _tile_width(k, group, args["BITS"])
    if group < k:
        chosen = {(width, *shape) for shape in _GROUPED}
    else:
        wide, half = _ROW_WIDE, _ROW_HALF
        if args["NORM"] or args["GATED"]:
            wide, half = wide + _FUSED_WIDE, half + _FUSED_HALF
        chosen = {(width, *shape) for shape in wide} | {(width // 2, *shape) for shape in half}
    if FOLD and args["BITS"] == 8 and group >= k:  # (folded: see `_ROW_DEEP`)
        chosen |= {(width, *shape) for shape in _ROW_DEEP}
    stored = k // 2 if args["BITS"] == 4 else k
    return [
        c
        for c in configs
        if (c.kwargs["BLOCK_K"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in chosen
        and not (c.kwargs["X_TILE"] and args["GATED"])
        and c.kwargs["INT8_BIASED"] in biased
        and _splits_fit(c.kwargs["SPLITS"], stored, c.kwargs["BLOCK_K"], args)
    ]


def _splits_fit(splits: int, length: int, step: int, args: dict) -> bool:
    """Whether a row of `length` (columns, or int4 groups) shares among `splits` programs that
    each take whole steps of `step`, within the product's MAX_SPLITS."""
    return splits <= args.get("MAX_SPLITS", 1) and length % (splits * step) == 0


def int8_biased(bits: int, group: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a product may take its int8 weights biased (`INT8_BIASED`)."""
    return INT8_BIASED and bits == 8 and group == k and dtype != torch.float32


# Tiles picked inside the decode step (benchmarks/tile_search.py), by GPU name and product. The
# autotuner times each tile alone, L2 flushed, while in the step the kernels launch early and
# overlap: on an H200 its picks ran the 1B's int8 up to 25% slower than others (session 16,
# docs/benchmarks.md). A product found here runs its tile untuned; LMFORGE_GEMV_TILES names
# another table, or `none` to tune every product.
TILES = Path(__file__).with_name("gemv_tiles.json")


def tile_key(args: dict) -> str:
    """A product's name in the table: `N K bits group` and its fusions (bits `4h`: int4 in
    packed fp16, `_gemv_int4`)."""
    names = ("NORM", "GATED", "RESIDUAL", "SWIGLU")
    fusions = [name.lower() for name in names if args.get(name)]
    bits = args.get("BITS", "4h")
    return " ".join(str(v) for v in (args["N"], args["K"], bits, args["GROUP"], *fusions))


def describe(config) -> str:
    """A tile in the table: `BLOCK_NxBLOCK_K vec|tile wWARPS sSTAGES[ biased][ fold][ kSPLITS]`."""
    kwargs = config.kwargs
    split = f" k{kwargs['SPLITS']}" if kwargs.get("SPLITS", 1) > 1 else ""
    if "GROUPS" in kwargs:  # `_gemv_int4`: `BLOCK_NxGROUPSg wWARPS sSTAGES[ kSPLITS]`
        shape = f"{kwargs['BLOCK_N']}x{kwargs['GROUPS']}g"
        return f"{shape} w{config.num_warps} s{config.num_stages}{split}"
    x = "tile" if kwargs["X_TILE"] else "vec"
    tile = f"{kwargs['BLOCK_N']}x{kwargs['BLOCK_K']} {x} w{config.num_warps} s{config.num_stages}"
    fold = " fold" if kwargs.get("FOLD") else ""
    return tile + (" biased" if kwargs["INT8_BIASED"] else "") + fold + split


@cache
def pinned_tiles(gpu: str) -> dict[str, str]:
    """The table's tiles for the GPU named `gpu` ({} where it has none, or where the table
    cannot be read: then every product is tuned, with a warning)."""
    path = os.environ.get("LMFORGE_GEMV_TILES") or str(TILES)
    if path == "none":
        return {}
    try:
        pins = json.loads(Path(path).read_text()).get(gpu, {})
        if not all(isinstance(v, str) for v in pins.values()):
            raise ValueError("each product's tile must be a string, as `describe` writes it")
        return pins
    except (OSError, ValueError, AttributeError) as e:
        log.warning("LMFORGE_GEMV_TILES=%s: %s; tuning every product instead", path, e)
        return {}


@cache
def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _fits(configs, named_args, **kwargs):
    """The autotuner's configs for one product: its pinned tile, or `_candidates`."""
    args = {**named_args, **kwargs}
    return _pinned(_candidates(configs, args), args)


def _pinned(candidates: list, args: dict) -> list:
    """The candidate that is the product's pinned tile, or all of them where none is pinned."""
    pin = pinned_tiles(gpu_name(args["w_ptr"].device)).get(tile_key(args))
    return [c for c in candidates if describe(c) == pin] or candidates


if INTERPRETED:  # the CPU (tests): no tuning, wide tiles (the interpreter runs programs in turn)
    _gemv_tuned = _gemv
else:
    _gemv_tuned = triton.autotune(
        _gemv_configs(),
        key=["N", "K", "BITS", "GROUP", "NORM", "GATED", "RESIDUAL", "SWIGLU", "MAX_SPLITS"],
        prune_configs_by={"early_config_prune": _fits},
        # The picks are kept in Triton's cache directory (~/.triton/cache, TRITON_CACHE_DIR)
        # for this GPU and kernel source: a later process starts without tuning and runs the
        # same tiles (delete the directory to tune again). The tuner times each tile alone,
        # not inside the step launched early, so picks can be poor there, and kept they stay:
        # on an H200 one tune ran the int8 1B at 1,057 tok/s in two processes, where four
        # fresh tunes ran it at 1,361-1,417 (docs/benchmarks.md, session 16). Hence the pinned
        # tiles (`TILES`), chosen inside the step.
        cache_results=True,
    )(_gemv)


INTERPRETED_X_TILE = True  # x as a tile where it may be (tests set False for the vector path)
INTERPRETED_SPLITS = 1  # programs a row is split among where it may be (tests set 2)
INTERPRETED_FOLD = False  # int8 of one scale a row folded (`_fold`; tests set True)


def _interpreted_splits(length: int, step: int, max_splits: int) -> int:
    """The interpreter's split count (`INTERPRETED_SPLITS` where the product takes it)."""
    fits = _splits_fit(INTERPRETED_SPLITS, length, step, {"MAX_SPLITS": max_splits})
    return INTERPRETED_SPLITS if fits else 1


def _interpreted_tiles(k, group, bits, gated, dtype, max_splits) -> dict:
    """The one configuration the interpreter runs: wide tiles (it runs programs in turn)."""
    x_tile = INTERPRETED_X_TILE and not gated
    biased = int8_biased(bits, group, k, dtype)
    stored = k // 2 if bits == 4 else k
    splits = _interpreted_splits(stored, MIN_TILE, max_splits)
    share = next(w for w in _WIDTHS if (stored // splits) % w == 0)  # the widest that divides it
    width = min(_tile_width(k, group, bits), share)
    tiles = {"BLOCK_N": 16, "BLOCK_K": width, "X_TILE": x_tile, "INT8_BIASED": biased}
    fold = INTERPRETED_FOLD and FOLD and bits == 8 and group >= k
    return tiles | {"SPLITS": splits, "FOLD": fold}


def _launch_gemv(x, w, scale, zero, bits, norm, eps, gated, residual, swiglu):
    n, stored = w.shape
    k = 2 * stored if bits == 4 else stored
    group = k // scale.shape[1] if scale is not None and scale.numel() else k  # (one: a row)
    if bits == 4 and int4_halves(group, x.dtype):
        return _launch_gemv_int4(x, w, scale, zero, group, norm, eps, gated, residual, swiglu)
    y, grid = _output(x, n, swiglu)
    early = early_launch(x.device)
    max_splits = _max_splits(norm, swiglu)
    _gemv_tuned[grid](
        x.contiguous(),
        w,
        scale if scale is not None else y,  # (any pointer where unused)
        zero if zero is not None else y,
        norm if norm is not None else y,
        residual.contiguous() if residual is not None else y,
        y,
        *_split_workspace(x.device, n, max_splits, y),
        n,
        k,
        eps,
        GROUP=group,
        BITS=bits,
        NORM=norm is not None,
        GATED=gated and x.shape[-1] == 2 * k,
        RESIDUAL=residual is not None,
        SWIGLU=swiglu,
        EARLY=early,
        PRELOAD=PRELOAD[bits] if early else 0,
        INT4_FROM_BITS=INT4_FROM_BITS and bits == 4,
        MAX_SPLITS=max_splits,
        launch_pdl=early,
        **(_interpreted_tiles(k, group, bits, gated, x.dtype, max_splits) if INTERPRETED else {}),
    )
    return y


def _output(x: torch.Tensor, n: int, swiglu: bool):
    """A product's output [1, N] (or [1, N/2], `swiglu`) and its grid: a program a tile of
    rows and share of a row (`SPLITS`)."""
    width = n // 2 if swiglu else n
    y = torch.empty(1, width, dtype=x.dtype, device=x.device)
    return y, lambda meta: (triton.cdiv(width, meta["BLOCK_N"] // (1 + swiglu)), meta["SPLITS"])


def _max_splits(norm, swiglu: bool) -> int:
    """The most programs a product's rows may be split among: a norm needs all of a row's x
    in each program (its sum of squares), and SiLU·up both halves of the output."""
    return max(SPLIT_COUNTS) if SPLIT_K and norm is None and not swiglu else 1


def _split_workspace(device: torch.device, n: int, max_splits: int, y: torch.Tensor) -> tuple:
    """(partial sums, counts) for a launch: `_workspace`'s where rows may be split, else y
    twice (any pointer where unused)."""
    return _workspace(device, n, max_splits) if max_splits > 1 else (y, y)


@cache
def _workspace(device: torch.device, n: int, splits: int) -> tuple:
    """Split-K's memory for products of N rows on `device`: partial sums [splits, N] and the
    row blocks' counts [N], zeros that `_combine` sets back to zero. Made once and kept (CUDA
    graphs that recorded it keep its address); one product at a time uses it, since each kernel
    of the step starts on it only after the one before has finished."""
    partial = torch.empty(splits, n, dtype=torch.float32, device=device)
    return partial, torch.zeros(n, dtype=torch.int32, device=device)


def int4_halves(group: int, dtype: torch.dtype) -> bool:
    """Whether an int4 product in groups of `group` columns runs in `_gemv_int4`: a
    group's low nibbles fill whole words, a power of two of them, at least 4. Never for fp32
    activations: fp16 products keep 11 bits, visible in an fp32 output, not in a bf16 one."""
    words = group // 4
    whole = group % 4 == 0 and words >= 4 and words & (words - 1) == 0
    return INT4_HALVES and whole and dtype != torch.float32


# (BLOCK_N, GROUPS, num_warps, num_stages) `_gemv_int4` tries; GROUPS must divide a row's groups
# of low nibbles. A thread reads 16 bytes of a row at a time (4 words), and holds BLOCK_N /
# num_warps rows where GROUPS x group / 128 threads span a row: x is made once for those rows.
_INT4_TILES = [
    (4, 4, 1, 1), (8, 4, 2, 1), (16, 4, 4, 1), (16, 4, 4, 3), (32, 4, 4, 1), (8, 2, 2, 1),
    (16, 2, 4, 3), (8, 8, 2, 1), (16, 8, 4, 1), (8, 1, 1, 1), (16, 1, 2, 3),
]  # fmt: skip


def _int4_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": n, "GROUPS": g, "SPLITS": k}, num_warps=w, num_stages=st)
        for n, g, w, st in _INT4_TILES
        for k in SPLIT_COUNTS
    ]


def _int4_candidates(configs, args: dict) -> list:
    """The configs to try for one int4 product: those whose groups divide a row's (or its
    share of a row, split)."""
    halves = args["K"] // 2 // args["GROUP"]
    return [c for c in configs if _splits_fit(c.kwargs["SPLITS"], halves, c.kwargs["GROUPS"], args)]


def _int4_fits(configs, named_args, **kwargs):
    """The autotuner's configs for one int4 product (its arguments by name, as it passes them:
    positional ones in `named_args`, the rest in `kwargs`): its pinned tile, or the candidates."""
    args = {**named_args, **kwargs}
    return _pinned(_int4_candidates(configs, args), args)


if INTERPRETED:
    _gemv_int4_tuned = _gemv_int4
else:
    _gemv_int4_tuned = triton.autotune(
        _int4_configs(),
        key=["N", "K", "GROUP", "NORM", "GATED", "RESIDUAL", "SWIGLU", "MAX_SPLITS"],
        prune_configs_by={"early_config_prune": _int4_fits},
        cache_results=True,
    )(_gemv_int4)


def _launch_gemv_int4(x, w, scale, zero, group, norm, eps, gated, residual, swiglu):
    n, stored = w.shape
    k = 2 * stored
    y, grid = _output(x, n, swiglu)
    early = early_launch(x.device)
    shift = _X_SHIFT_GATED if gated else _X_SHIFT
    max_splits = _max_splits(norm, swiglu)
    interpreted = {}
    if INTERPRETED:  # wide tiles: the interpreter runs programs in turn
        halves = k // 2 // group
        splits = _interpreted_splits(halves, 1, max_splits)
        groups = max(g for g in (1, 2, 4) if (halves // splits) % g == 0)
        interpreted = {"BLOCK_N": 16, "GROUPS": groups, "SPLITS": splits}
    _gemv_int4_tuned[grid](
        x.contiguous(),
        w.view(torch.int32),  # [N, K/8]: the bytes four to a word
        scale,
        zero,
        norm if norm is not None else y,
        residual.contiguous() if residual is not None else y,
        y,
        *_split_workspace(x.device, n, max_splits, y),
        n,
        k,
        eps,
        GROUP=group,
        NORM=norm is not None,
        GATED=gated and x.shape[-1] == 2 * k,
        RESIDUAL=residual is not None,
        EARLY=early,
        PRELOAD=int(early),
        SWIGLU=swiglu,
        MAX_SPLITS=max_splits,
        DOWN=2.0**-shift,
        UP=2.0**shift,
        launch_pdl=early,
        **interpreted,
    )
    return y


@torch.library.custom_op("lmforge::gemv", mutates_args=())
def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    bits: int = 16,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """One row of activations times a weight: [1, N]. The weight is plain (bits 16: [N, K],
    bf16, fp16, fp32) or quantized (`q`, `scale`, `zero` in the module docstring's layouts).
    What the decode step did around the product can happen inside it: `norm` (the RMSNorm
    weight, with `eps`): x [1, K] is the residual stream and the product takes its norm;
    `gated`: x is SiLU·up, given as [1, 2K] gate and up (the product takes silu(gate) * up)
    or as [1, K] made already; `residual` [N]: it is added to the product; `swiglu`: the
    weight is [gate; up] and the output [1, N/2] is silu(gate) * up of the two halves."""
    return _launch_gemv(x, weight, scale, zero, bits, norm, eps, gated, residual, swiglu)


@gemv.register_fake
def _(x, weight, scale=None, zero=None, bits=16, norm=None, eps=0.0, gated=False, residual=None,
      swiglu=False):  # fmt: skip
    return x.new_empty(1, weight.shape[0] // 2 if swiglu else weight.shape[0])


@torch.library.custom_op("lmforge::quantized_matmul", mutates_args=())
def quantized_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:
    """x [M, K] @ w.T for a quantized w (module docstring's layouts) and several rows: up to
    `quantized_gemm.MAX_ROWS`, dequantized tile by tile in the product; more, w expanded to
    x's dtype, then one matmul: [M, N] in x's dtype."""
    if quantized_gemm.supported(x, q, scale, bits):
        return quantized_gemm.quantized_gemm(x, q, scale, zero, bits)
    return F.linear(x, dequantize(q, scale, zero, bits, x.dtype))


@quantized_matmul.register_fake
def _(x, q, scale, zero, bits):
    return x.new_empty(x.shape[0], q.shape[0])


def dequantize(q, scale, zero, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` from its quantized layout."""
    n, stored = q.shape
    k = 2 * stored if bits == 4 else stored
    out = torch.empty(n, k, dtype=dtype, device=q.device)
    block_n, block_k = 16, 64  # any: each value looks up its own group's scale
    grid = (triton.cdiv(n, block_n), triton.cdiv(stored, block_k))
    group = k // scale.shape[1]
    _dequantize[grid](
        q, scale, zero, out, n, k, GROUP=group, BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k
    )
    return out


def one_row(x: torch.Tensor) -> bool:
    """Whether x is a single row of activations where the GEMV runs (CUDA, the interpreter)."""
    return x.numel() == x.shape[-1] and (x.is_cuda or INTERPRETED)


class _MatvecLayer(nn.Module):
    """A bias-free linear whose single-row products run in `_gemv`; `matvec` takes what the
    decode step does around the product into the same kernel (`FusedDecodeBlock`). A subclass
    defines `weight_args()`: `gemv`'s weight arguments (weight or q, scale, zero, bits)."""

    def matvec(
        self,
        x: torch.Tensor,
        *,
        norm: nn.Module | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """One row x [..., K] -> [..., N]: the product of RMSNorm(x) with `norm` (an
        RMSNorm), of SiLU·up when `gated` (x [..., 2K], gate and up, or [..., K] made), plus
        `residual` [..., N]; `swiglu`: silu(gate) * up of the output's halves, [..., N/2]."""
        y = gemv(
            x.reshape(1, -1),
            *self.weight_args(),
            norm=norm.weight if norm is not None else None,
            eps=norm.eps if norm is not None else 0.0,
            gated=gated,
            residual=residual.reshape(-1) if residual is not None else None,
            swiglu=swiglu,
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])


class GemvLinear(_MatvecLayer):
    """A bias-free linear over a plain weight that multiplies one row of activations with
    `_gemv` (on CUDA, or under the interpreter) and more rows with `F.linear`. It holds the
    linear's own parameter, so state dicts and tied weights stay as they were."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def weight_args(self) -> tuple:
        return self.weight, None, None, 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matvec(x) if one_row(x) else F.linear(x, self.weight)


class QuantizedLinear(_MatvecLayer):
    """A bias-free linear over a quantized weight in the kernels' layout (module docstring):
    `from_linear` converts a torchao weight-only linear, `concatenate` joins several along
    their outputs (fused projections). Inference only: the weight is buffers, not parameters.
    One row goes through `_gemv`; more through bf16 expansion and one matmul."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int):
        super().__init__()
        self.bits = bits
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def weight_args(self) -> tuple:
        return self.q, self.scale, self.zero, self.bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_row(x):
            return self.matvec(x)
        rows = x.reshape(-1, x.shape[-1])
        y = quantized_matmul(rows, self.q, self.scale, self.zero, self.bits)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @classmethod
    def from_linear(cls, linear: nn.Module, *, tinygemm: bool = False) -> QuantizedLinear | None:
        """The kernels' copy of a bias-free linear's torchao weight (int8 weight-only per row
        or group; int4 unpacked, as made on the CPU; tinygemm's int4 when `tinygemm`), or None
        for any other weight."""
        if type(linear) is not nn.Linear or linear.bias is not None:
            return None
        values = quantized_values(linear.weight.data, tinygemm=tinygemm)
        if values is None:
            return None
        bits, q, scale, zero = values
        if bits == 8 and INT8_OFFSET:  # q + 128 as uint8, which the byte permutes take as it is
            q = q.view(torch.uint8) ^ 0x80
        if bits == 4:
            half = q.shape[1] // 2
            q = (q[:, :half] | (q[:, half:] << 4)).to(torch.uint8)  # [N, K/2]
        return cls(q.contiguous(), scale.contiguous(), zero.contiguous(), bits)

    @staticmethod
    def joinable(linears: list[nn.Module]) -> bool:
        """Whether `concatenate` takes `linears`: all of this type, one layout and group size."""
        first = linears[0]
        return all(
            type(lin) is QuantizedLinear
            and lin.bits == first.bits
            and lin.q.shape[1] == first.q.shape[1]
            and lin.scale.shape[1] == first.scale.shape[1]
            for lin in linears
        )

    @classmethod
    def concatenate(cls, linears: list[QuantizedLinear]) -> QuantizedLinear:
        """One linear whose outputs are `linears`' in order (`joinable`)."""
        first = linears[0]
        if not cls.joinable(linears):
            raise ValueError("only linears of one layout and group size can be joined")
        joined = [
            torch.cat([getattr(lin, name) for lin in linears]) for name in ("q", "scale", "zero")
        ]
        return cls(*joined, first.bits)


def quantized_values(weight: torch.Tensor, *, tinygemm: bool = False):
    """(bits, q [N, K], scale [N, groups], zero [N, groups]) of a torchao weight-only tensor,
    w = q * scale (bits 8) or (q - 8) * scale + zero (bits 4, q in 0..15); None for a layout
    these kernels do not read (activation quantization, pre-scales, other formats). tinygemm's
    int4 (`Int4TilePackedTo4dTensor`) only when `tinygemm`: at one row `_gemv_int4` is faster
    than tinygemm, at many bf16 expansion + cuBLAS is."""
    kind = type(weight).__name__
    known = {"Int8Tensor", "IntxUnpackedToInt8Tensor"}
    if tinygemm:
        known.add("Int4TilePackedTo4dTensor")
    if kind not in known:
        return None
    if getattr(weight, "act_quant_kwargs", None) is not None:
        return None
    if getattr(weight, "act_pre_scale", None) is not None:
        return None
    n, k = weight.shape
    if k % (2 * MIN_TILE) or weight.block_size[-1] % MIN_TILE:
        return None  # rows or groups the GEMV's narrowest tile does not divide
    if kind == "Int8Tensor":
        if weight.zero_point is not None and bool(weight.zero_point.any()):
            return None
        scale = weight.scale.reshape(n, -1)
        return 8, weight.qdata, scale, scale.new_empty(n, 0)  # no zero (symmetric)
    if (k // 2) % weight.block_size[-1]:
        return None  # int4 pairs q[j], q[j + K/2] must sit in whole groups
    if kind == "IntxUnpackedToInt8Tensor" and weight.target_dtype == torch.int4:
        scale = weight.scale.reshape(n, -1)
        zero = -weight.zero_point.reshape(n, -1).to(scale.dtype) * scale  # w = (q - zp) s
        return 4, (weight.qdata.to(torch.int16) + 8).to(torch.uint8), scale, zero
    if kind == "Int4TilePackedTo4dTensor":
        return _tinygemm_values(weight)
    return None  # int8 as the storage of other integer widths


def _tinygemm_values(weight: torch.Tensor):
    """tinygemm's int4 values, recovered exactly from its packed tiles: the kernel applied to
    rows of the identity gives the dequantized weight, (q - 8) * scale + zero, in bf16."""
    n, k = weight.shape
    group = weight.block_size[-1]
    pairs = weight.scale_and_zero.transpose(0, 1)  # [N_padded, K_padded / group, 2]
    scale = pairs[:n, : k // group, 0].contiguous()
    zero = pairs[:n, : k // group, 1].contiguous()
    padded_k = weight.scale_and_zero.shape[0] * group
    q = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
    for start in range(0, k, 2048):
        stop = min(start + 2048, k)
        eye = torch.zeros(stop - start, padded_k, dtype=torch.bfloat16, device=weight.device)
        at = torch.arange(stop - start, device=weight.device)
        eye[at, start + at] = 1
        w = torch.ops.aten._weight_int4pack_mm(eye, weight.qdata, group, weight.scale_and_zero)
        w = w[:, :n].t().float()  # [N, columns start..stop]
        cols = torch.arange(start, stop, device=weight.device) // group
        s, z = scale[:, cols].float(), zero[:, cols].float()
        values = torch.round((w - z) / s + 8).clamp_(0, 15)
        if not bool((((values - 8) * s + z - w).abs() <= 0.25 * s.abs()).all()):
            return None  # a value the formula does not give back: keep torchao's kernel
        q[:, start:stop] = values.to(torch.uint8)
    return 4, q, scale, zero


def use_quantized_kernels(model: nn.Module, *, tinygemm: bool = False) -> int:
    """Swap every torchao weight-only linear of `model` that these kernels read for a
    `QuantizedLinear` (tinygemm's int4 too when `tinygemm`); returns how many were swapped."""
    return _swap(model, partial(QuantizedLinear.from_linear, tinygemm=tinygemm))


def use_gemv(model: nn.Module) -> int:
    """Swap every bias-free linear of `model` over a plain floating-point weight for a
    `GemvLinear` (same parameter); returns how many were swapped."""

    def swap(linear: nn.Module) -> GemvLinear | None:
        plain = (
            type(linear) is nn.Linear
            and linear.bias is None
            and type(linear.weight.data) is torch.Tensor
            and linear.weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and linear.in_features % MIN_TILE == 0  # (a LoRA's B of rank 8 stays)
        )
        return GemvLinear(linear.weight) if plain else None

    return _swap(model, swap)


# SiLU·up made once, by w13's programs (each holds gate and up rows i side by side), not by each
# of w2's programs as they load their input (all of it: 8,192 sigmoids a program on the 1B). On
# an H200 (2026-12-02, docs/benchmarks.md, autotuned tiles both ways): 1B bf16 +4.6%, int8
# +6.9%, 3B bf16 +5.1%, the 1B's int4 step 0.667 ms against 0.735. False: in w2 (the A/B in
# benchmarks/decode.py, variant lmforge-swiglu-in-w2).
SWIGLU_IN_W13 = True


class FusedDecodeBlock:
    """A transformer block whose single-row forward (batch-1 decoding) is four GEMV launches
    around one attention kernel, with the block's other work inside them: each RMSNorm in the
    product that reads it (wqkv, w13: x times the norm's weight as it is loaded, 1 / rms at the
    end), SiLU·up after w13's products (`SWIGLU_IN_W13`), the residual adds after wo's and
    w2's products, and RoPE with the cache write in the attention kernel (`decode_attention`;
    against a decode step's static cache, otherwise the model's own attention). Unfused, each
    of those is a kernel of its own: on an H200 the 1B step had 183 kernels and took 1.054 ms;
    fused with cuDNN's attention 136 and 0.983 ms; with the attention kernel 88 and 0.890 ms
    (torch.profiler; docs/benchmarks.md). More rows take the block's own forward. A mixin:
    `use_fused_blocks` swaps a block's class for one deriving from this and the family's own
    block class, so names and the state dict stay."""

    def forward(self, x, cos, sin, attn_mask=None, kv_cache=None):
        if not one_row(x):
            return super().forward(x, cos, sin, attn_mask, kv_cache)
        attention, ffn = self.attention, self.feed_forward
        qkv = attention.wqkv.matvec(x, norm=self.attention_norm)
        heads = _attend_one_row(attention, qkv, cos, sin, attn_mask, kv_cache)
        h = attention.wo.matvec(heads, residual=x)
        gated = ffn.w13.matvec(h, norm=self.ffn_norm, swiglu=SWIGLU_IN_W13)
        return ffn.w2.matvec(gated, gated=True, residual=h)


def _attend_one_row(attention: nn.Module, qkv, cos, sin, attn_mask, kv_cache) -> torch.Tensor:
    """A decoding row's attention of its fused projections qkv [1, 1, ...] -> [1, 1, heads *
    head_dim]: RoPE, the cache write and attention in one kernel (`decode_attention`) against
    a decode step's static cache without per-head norms; otherwise (a prefill's view of the
    cache, no cache, shapes the kernel does not take) the model's own `attend`."""
    heads = attention.fused_sizes[0] // attention.head_dim
    if (
        isinstance(kv_cache, StaticKVCache)
        and attention.q_norm is None
        and supported(heads, kv_cache.k.shape[1], attention.head_dim)
    ):
        return decode_attention(
            qkv.view(1, -1),
            cos.view(1, -1),
            sin.view(1, -1),
            kv_cache.k,
            kv_cache.v,
            kv_cache.positions.view(1),
            heads,
            kv_cache.kv_len,
        ).view(1, 1, -1)
    q, k, v = qkv.split(attention.fused_sizes, dim=-1)
    return attention.attend(q, k, v, cos, sin, attn_mask, kv_cache)


@cache
def _fused_class(block_class: type) -> type:
    """`FusedDecodeBlock` over a family's block class."""
    return type(f"FusedDecode{block_class.__name__}", (FusedDecodeBlock, block_class), {})


def use_fused_blocks(model: nn.Module) -> int:
    """Make every block of `model` whose projections are fused (`fuse_projections`) and run in
    these kernels a `FusedDecodeBlock`; returns how many."""
    fused = 0
    for block in model.layers.values():
        attention, ffn = block.attention, block.feed_forward
        linears = (attention.wqkv, attention.wo, ffn.w13, ffn.w2)
        if not isinstance(block, FusedDecodeBlock) and all(
            isinstance(linear, _MatvecLayer) for linear in linears
        ):
            block.__class__ = _fused_class(type(block))
            fused += 1
    return fused


def _swap(model: nn.Module, replacement) -> int:
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if child._forward_hooks or child._forward_pre_hooks:
                continue  # e.g. tensor parallelism's all-reduce after a row-parallel linear
            new = replacement(child)
            if new is not None:
                setattr(module, name, new)
                swapped += 1
    return swapped
