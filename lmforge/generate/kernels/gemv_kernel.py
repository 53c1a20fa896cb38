"""`_gemv`: one row of activations times a weight as stored (bits 16: bf16, fp16 or fp32; 8: int8
through int8.py's conversions, or float8 e4m3 through the converter; 4: int4 bytes through int4.py's), with the decode block's norm,
SiLU·up, residual add or SwiGLU inside, and its launch (`_launch_gemv`, which hands int4 to
`_gemv_int4` where that kernel takes it). `_gemv` keeps a [BLOCK_N, BLOCK_K] fp32 accumulator
over the whole row and reduces it once at the end, so its loop is loads, conversions and fused
multiply-adds only. Its switches: `PRELOAD` (weight tiles loaded before the wait) and
`INT4_FROM_BITS` (how its int4 nibbles become floats).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmforge.generate.early_launch import INTERPRETED, early_launch, wait_for_previous
from lmforge.generate.kernels.int4 import (
    _int4_times,
    _int4_values,
    _launch_gemv_int4,
    int4_halves,
)
from lmforge.generate.kernels.int8 import _int8_biased, _int8_values
from lmforge.generate.kernels.shared import (
    _activation,
    _finish,
    _output,
    _rows,
    _split_begin,
    _split_workspace,
)
from lmforge.generate.kernels.tiles import (
    _fits,
    _gemv_configs,
    _interpreted_tiles,
    _max_splits,
    autotune,
)

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


@triton.jit
def _gemv(
    x_ptr,  # [K] activations; [2K] (gate, up) when GATED
    w_ptr,  # [N, K] (bf16, int8, float8 e4m3) or [N, K/2] (int4 pairs)
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
    float8: tl.constexpr = w_ptr.dtype.element_ty.is_fp8()  # (BITS 8) e4m3, not int8
    biased: tl.constexpr = INT8_BIASED and BITS == 8 and GROUP == K and not float8
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
def _weights(w_ptr, rows, row_ok, stored, k0, BLOCK_K: tl.constexpr):
    """The weight tile [rows, k0:k0 + BLOCK_K] as stored."""
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(
        w_ptr + rows[:, None] * stored + cols[None, :],
        mask=row_ok[:, None],
        other=0.0,  # (a float: Triton casts no integer to float8)
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
        acc += _fold(_byte_values(w) * x, run)
    elif BITS == 8:
        scale = tl.load(scale_ptr + rows * groups + k0 // GROUP, mask=row_ok, other=0)
        acc += _fold(_byte_values(w) * scale.to(tl.float32)[:, None] * x, run)
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
def _byte_values(w):
    """A tile of 8-bit weights as fp32: float8 e4m3 by the converter (sm_90 makes two a
    `cvt`), int8 by `_int8_values`."""
    if w.dtype.is_fp8():
        values = w.to(tl.float32)
    else:
        values = _int8_values(w)
    return values


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


if INTERPRETED:  # the CPU (tests): no tuning, wide tiles (the interpreter runs programs in turn)
    _gemv_tuned = _gemv
else:
    # The tuner times each tile alone, not inside the step launched early, so picks can be
    # poor there, and kept (in Triton's cache) they stay: on an H200 one tune ran the int8 1B
    # at 1,057 tok/s in two processes, where four fresh tunes ran it at 1,361-1,417
    # (docs/benchmarks.md, session 16). Hence the pinned tiles (`TILES`), chosen in the step.
    _gemv_tuned = autotune(
        _gemv_configs(),
        key=["N", "K", "BITS", "GROUP", "NORM", "GATED", "RESIDUAL", "SWIGLU", "MAX_SPLITS"],
        prune=_fits,
    )(_gemv)


def _launch_gemv(x, w, scale, zero, bits, norm, eps, gated, residual, swiglu):
    n, stored = w.shape
    k = 2 * stored if bits == 4 else stored
    group = k // scale.shape[1] if scale is not None and scale.numel() else k  # (one: a row)
    if bits == 4 and int4_halves(group, x.dtype):
        return _launch_gemv_int4(x, w, scale, zero, group, norm, eps, gated, residual, swiglu)
    y, grid = _output(x, n, swiglu)
    early = early_launch(x.device)
    max_splits = _max_splits(norm, swiglu)
    interpreted = {}  # the interpreter's one tile, where the autotuner does not run
    if INTERPRETED:
        interpreted = _interpreted_tiles(k, group, bits, gated, x.dtype, w.dtype, max_splits)
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
        **interpreted,
    )
    return y
