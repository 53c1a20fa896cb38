"""int4 weights in the GEMV (module layout: uint8 [N, K/2], byte j of a row holding q[j] low and
q[j + K/2] high). Two ways: as bytes in `_gemv` (its nibbles made floats by `_int4_values` or the
converter, then `_int4_times`), or, where `int4_halves` allows (`INT4_HALVES`), in `_gemv_int4`:
a row's bytes read four to a word and multiplied in packed fp16 (`_int4_words_times`, ptx.py's
`_int4_asm`), with its own autotuned launch (`_launch_gemv_int4`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.generate.early_launch import INTERPRETED, early_launch, wait_for_previous
from lmforge.generate.kernels.ptx import _INT4_ASM, _INT4_CONSTRAINTS, ASSEMBLY
from lmforge.generate.kernels.shared import (
    _activation,
    _finish,
    _output,
    _rows,
    _split_begin,
    _split_workspace,
)
from lmforge.generate.kernels.tiles import (
    _int4_configs,
    _int4_fits,
    _interpreted_splits,
    _max_splits,
    autotune,
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


def int4_halves(group: int, dtype: torch.dtype) -> bool:
    """Whether an int4 product in groups of `group` columns runs in `_gemv_int4`: a
    group's low nibbles fill whole words, a power of two of them, at least 4. Never for fp32
    activations: fp16 products keep 11 bits, visible in an fp32 output, not in a bf16 one."""
    words = group // 4
    whole = group % 4 == 0 and words >= 4 and words & (words - 1) == 0
    return INT4_HALVES and whole and dtype != torch.float32


if INTERPRETED:
    _gemv_int4_tuned = _gemv_int4
else:
    _gemv_int4_tuned = autotune(
        _int4_configs(),
        key=["N", "K", "GROUP", "NORM", "GATED", "RESIDUAL", "SWIGLU", "MAX_SPLITS"],
        prune=_int4_fits,
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
