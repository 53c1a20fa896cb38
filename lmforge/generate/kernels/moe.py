"""A Mixture-of-Experts feed-forward's experts for a few tokens in two Triton kernels that read
only the chosen experts' weights (`fused_experts`), and the module that runs them in the engine
(`FusedExperts`, installed by `use_fused_experts`).

At decode a step runs a few tokens, each through k of E experts (Qwen3-30B-A3B: 8 of 128), so
the experts' work is reading k·tokens experts' weights, a few multiply-adds a byte. The grouped
path (lmforge/models/moe.py) gets there through a dozen kernels (argsort, scatter-add, cumsum,
gathers, two grouped GEMMs whose row tiles hold a row or two each, the weighted sum back);
here the (token, choice) pairs index the stacked weights directly:

1. `_gate_up`, a program per pair p = (t, s) and block of the expert's I rows: with e =
   experts[t, s] read on the device, gate = x[t]·w13[e, :I]ᵀ and up = x[t]·w13[e, I:]ᵀ in fp32,
   h[p] = silu(gate)·up stored in x's dtype ([tokens·k, I]).
2. `_down`, a program per token and block of dim: out[t] = Σ_s weights[t, s] · h[(t, s)]·
   w2[experts[t, s]]ᵀ, one fp32 sum over the k choices and one store (no atomics).

Sums are fp32 throughout, rounded to x's dtype twice (h, out), where the loop and the grouped
path round each projection's output, SiLU·up, each weighted term and the running sum: in bf16
the results differ by that rounding (tests/test_moe_kernels.py).

Nothing is read on the host, so the engine's CUDA graphs record it. A pair reads its expert
whatever the other pairs chose, so a repeated expert is read again (from L2 if it is still
there): past `FUSED_PAIRS` pairs the grouped path, which reads each chosen expert once, is the
one taken (`routed_experts`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from lmforge.generate.early_launch import INTERPRETED
from lmforge.generate.kernels.gemv_kernel import _byte_values
from lmforge.generate.kernels.int4 import _int4_values
from lmforge.models import moe

# The most (token, choice) pairs the fused kernels take; more go the grouped path. Not measured
# yet (benchmarks/moe_layer.py's fused rows, `bash benchmarks/device_calls.sh moe`, are there
# to set it). Why 64: with k = 8 of 128 experts that is decode batches 1-8. Under uniform
# routing 64 pairs hit ~50 distinct experts of 128 (E·(1 - (1 - 1/E)^pairs)), so reading a
# pair's expert for each pair reads ~1.3x the bytes of reading each chosen expert once, where
# the grouped path spends a dozen launches and GEMM row tiles padded around 1-2 rows an expert;
# at 256 pairs it would be ~112 of 128, 2.3x.
FUSED_PAIRS = 64
# The same for quantized experts, where the other path dequantizes every expert of the layer
# first (`moe.dequantize`: Qwen3-30B-A3B's int4 layer read as 0.3 GB and written and read
# again as 2 x 1.2 GB of bf16, whatever the batch), so the fused kernels, which read each pair's
# expert as stored (2.4 MB int4, 4.7 MB int8), read fewer bytes up to ~1,000 pairs int4 and
# ~600 int8: 512 pairs are decode batches up to 64 with k = 8. Not measured yet. (The
# interpreter, which runs programs in turn, keeps FUSED_PAIRS: the tests' prefills stay quick.)
QUANTIZED_FUSED_PAIRS = FUSED_PAIRS if INTERPRETED else 512

# (BLOCK_N rows, BLOCK_K columns, num_warps) of each kernel on a GPU: first picks in the range
# of the GEMV's tiles (tiles.py's `_ROW_WIDE`: 2-8 rows of up to 1024 columns, 4-8 warps), not
# tuned. A gate/up program holds BLOCK_N gate and BLOCK_N up rows; BLOCK_K is cut to the
# reduced length's power of two where that is shorter.
GATE_UP_TILE = (4, 512, 4)
DOWN_TILE = (4, 256, 4)
# The interpreter's (the tests): narrow enough that their odd shapes take several row blocks,
# several column steps and a masked last one of each.
INTERPRETED_TILE = (16, 32, 1)


@triton.jit
def _scale(scale, FP4: tl.constexpr):
    """Loaded scales in fp32: as they are, or (FP4: MXFP4's bytes) 2^(byte - 127) times 2^14,
    the factor `_e2m1_values` leaves out."""
    if FP4:
        return tl.exp2(scale.to(tl.float32) - 113.0)
    return scale.to(tl.float32)


@triton.jit
def _e2m1_values(byte):
    """Both nibbles of uint8 MXFP4 bytes (e2m1: sign, two exponent bits, one mantissa bit; the
    low nibble the even column) as fp32 times 2^-14, from their bits: the three magnitude bits
    set into an fp16's exponent and mantissa (bits 9-11) give 2^(e - 15)·(1 + m/2), and for e
    = 0 fp16's subnormal m·2^-15: the e2m1 value times 2^-14 either way (`_scale` puts 2^14
    back); the sign goes to bit 15. No converter from integers, no select."""
    bits = byte.to(tl.uint16)
    low = ((bits & 7) << 9) | ((bits & 8) << 12)
    high = ((bits & 0x70) << 5) | ((bits & 0x80) << 8)
    return (
        low.to(tl.float16, bitcast=True).to(tl.float32),
        high.to(tl.float16, bitcast=True).to(tl.float32),
    )


@triton.jit
def _columns(k0, LEN: tl.constexpr, PACKED: tl.constexpr, G: tl.constexpr, W: tl.constexpr):
    """A step's stored columns (bytes where PACKED) from column k0, [1, G, W] (G groups of W
    values, one scale each), and which a row has."""
    first = k0 // 2 if PACKED else k0
    stored = first + tl.arange(0, G)[None, :, None] * W + tl.arange(0, W)[None, None, :]
    return stored, stored < (LEN // 2 if PACKED else LEN)


@triton.jit
def _inputs(x_ptr, stored, col_ok, mult, PACKED: tl.constexpr, FP4: tl.constexpr):
    """A step's inputs at `_columns`' `stored`, times `mult`, as `_products` takes them: (x,
    x, 0) for values one a column; PACKED, with x0 / x1 the inputs of a byte's low / high
    nibble (the even / odd columns): (x0, x1, 0) for MXFP4, and for int4 (2·x0, x1 / 8, 264·x0
    + 24·x1), which `_int4_values`' floats v0 = 128 + (n0 + 8)/2, v1 = 128 + 8·(n1 + 8) turn
    into n0·x0 + n1·x1 = v0·(2·x0) + v1·(x1 / 8) - (264·x0 + 24·x1)."""
    offset = 0.0
    if PACKED:  # (one return: the compiler wants every return of one type)
        x0 = tl.load(x_ptr + 2 * stored, mask=col_ok, other=0).to(tl.float32) * mult
        x1 = tl.load(x_ptr + 2 * stored + 1, mask=col_ok, other=0).to(tl.float32) * mult
        if not FP4:
            offset = 264.0 * x0 + 24.0 * x1
            x0, x1 = 2.0 * x0, 0.125 * x1
    else:
        x0 = tl.load(x_ptr + stored, mask=col_ok, other=0).to(tl.float32) * mult
        x1 = x0
    return x0, x1, offset


@triton.jit
def _products(
    rows_ptr,  # [BLOCK_N, 1]: each row's first stored value
    scales_ptr,  # [BLOCK_N, 1]: each row's first scale
    xs,  # `_inputs`' three
    stored,  # `_columns`' [1, G, W]
    ok,  # [BLOCK_N, G, W]: the row's and the column's
    k0,
    row_ok,  # [BLOCK_N]
    PACKED: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,  # columns a scale covers, scaled here (0: none, or by the caller)
    FP4: tl.constexpr,
    G: tl.constexpr,
):
    """The step's weights from column k0 times their inputs, scaled a group at a time: [BLOCK_N,
    G, W] fp32 to add up. Floats as they are; QUANT: int8 by `_int8_values`, float8 by the
    converter; PACKED: 4 bits two a byte, the low nibble the even column, int4 (two's
    complement, made n + 8 by an xor) by `_int4_values`, MXFP4 by `_e2m1_values`. No integer
    reaches the converter (a quarter of the FMA rate on Hopper) and a scale is loaded once a
    row and group, not once a weight."""
    x0, x1, offset = xs
    raw = tl.load(rows_ptr[:, :, None] + stored, mask=ok, other=0.0)
    if PACKED and FP4:
        low, high = _e2m1_values(raw)
        products = low * x0 + high * x1
    elif PACKED:
        low, high = _int4_values(raw ^ 0x88)
        products = low * x0 + high * x1 - offset
    elif QUANT:
        products = _byte_values(raw) * x0
    else:
        products = raw.to(tl.float32) * x0
    if GROUP > 0:
        groups = k0 // GROUP + tl.arange(0, G)[None, :, None]
        scale = tl.load(scales_ptr[:, :, None] + groups, mask=row_ok[:, None, None], other=0)
        products *= _scale(scale, FP4)
    return products


def _tileable(group: int, block_k: int) -> bool:
    """Whether the kernels' steps of `block_k` columns (a power of two) lie in whole groups of
    `group` columns scaled in the loop (0: none, or one scale a row, applied to its sum): a
    multiple of the step, or a power of two below it."""
    if group == 0 or group % block_k == 0:
        return True
    return group < block_k and group & (group - 1) == 0


def _groups_fit(dim: int, ffn: int, w13_scale, w2_scale) -> bool:
    """Whether `fused_experts` takes scales of these shapes (`_tileable`; no scales: yes)."""
    if w13_scale is None:
        return True
    for scale, length, tile in ((w13_scale, dim, GATE_UP_TILE), (w2_scale, ffn, DOWN_TILE)):
        group = length // scale.shape[-1]
        if not _tileable(0 if group == length else group, _tile(tile, length)[1]):
            return False
    return True


@triton.jit
def _gate_up(
    x_ptr,  # [tokens, DIM]
    w13_ptr,  # [E, 2 * FFN, DIM]: each expert's gate rows, then its up rows (PACKED: DIM / 2)
    scale_ptr,  # [E, 2 * FFN, DIM / GROUP]: the weights' scales (GROUP 0: none, unread)
    bias_ptr,  # [E, 2 * FFN]: gate then up biases (HAS_BIAS; else unread)
    experts_ptr,  # [tokens * TOP_K] int64: pair p = t * TOP_K + s chose expert experts[p]
    h_ptr,  # [tokens * TOP_K, FFN] out, x's dtype: silu(gate) * up of each pair
    DIM: tl.constexpr,
    FFN: tl.constexpr,
    TOP_K: tl.constexpr,
    PACKED: tl.constexpr,
    GROUP: tl.constexpr,
    FP4: tl.constexpr,  # MXFP4 (PACKED): e2m1 values, scales the bytes of powers of two
    HAS_BIAS: tl.constexpr,
    LIMIT: tl.constexpr,  # > 0: gpt-oss's clamped SwiGLU, (up + 1)·gate·σ(ALPHA·gate)
    ALPHA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(experts_ptr + pair).to(tl.int64)  # (int64: E · 2I · dim may pass 2^31)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < FFN
    row_len: tl.constexpr = DIM // 2 if PACKED else DIM
    gate_rows = w13_ptr + expert * (2 * FFN * row_len) + rows[:, None] * row_len  # [BLOCK_N, 1]
    up_rows = gate_rows + FFN * row_len
    groups: tl.constexpr = DIM // GROUP if GROUP > 0 else 1
    gate_scales = scale_ptr + expert * (2 * FFN * groups) + rows[:, None] * groups
    up_scales = gate_scales + FFN * groups
    # a scale a row multiplies the row's sum, not every weight
    tile_group: tl.constexpr = 0 if GROUP == DIM else GROUP
    span: tl.constexpr = tile_group if (tile_group > 0 and tile_group < BLOCK_K) else BLOCK_K
    G: tl.constexpr = BLOCK_K // span  # a step's groups of one scale
    W: tl.constexpr = span // 2 if PACKED else span  # and a group's stored values
    gate = tl.zeros([BLOCK_N, G, W], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, G, W], dtype=tl.float32)
    for k0 in range(0, DIM, BLOCK_K):
        stored, col_ok = _columns(k0, DIM, PACKED, G, W)
        xs = _inputs(x_ptr + token * DIM, stored, col_ok, 1.0, PACKED, FP4)
        ok = row_ok[:, None, None] & col_ok
        gate += _products(
            gate_rows, gate_scales, xs, stored, ok, k0, row_ok, PACKED, GROUP > 0, tile_group, FP4, G
        )  # fmt: skip
        up += _products(
            up_rows, up_scales, xs, stored, ok, k0, row_ok, PACKED, GROUP > 0, tile_group, FP4, G
        )  # fmt: skip
    g = tl.sum(tl.sum(gate, axis=2), axis=1)  # [BLOCK_N], reduced once, after the loop
    u = tl.sum(tl.sum(up, axis=2), axis=1)
    if GROUP == DIM:
        row_scales = scale_ptr + expert * (2 * FFN) + rows  # [BLOCK_N]: one a row
        g *= _scale(tl.load(row_scales, mask=row_ok, other=0), FP4)
        u *= _scale(tl.load(row_scales + FFN, mask=row_ok, other=0), FP4)
    if HAS_BIAS:
        biases = bias_ptr + expert * (2 * FFN) + rows
        g += tl.load(biases, mask=row_ok, other=0).to(tl.float32)
        u += tl.load(biases + FFN, mask=row_ok, other=0).to(tl.float32)
    if LIMIT > 0:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        h = (u + 1) * g * tl.sigmoid(g * ALPHA)
    else:
        h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + pair * FFN + rows, h.to(h_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _down(
    h_ptr,  # [tokens * TOP_K, FFN]
    w2_ptr,  # [E, DIM, FFN] (PACKED: FFN / 2)
    scale_ptr,  # [E, DIM, FFN / GROUP] (GROUP 0: none, unread)
    bias_ptr,  # [E, DIM] (HAS_BIAS; else unread)
    weights_ptr,  # [tokens * TOP_K]: the router's weight of each pair
    experts_ptr,  # [tokens * TOP_K] int64
    out_ptr,  # [tokens, DIM]
    DIM: tl.constexpr,
    FFN: tl.constexpr,
    TOP_K: tl.constexpr,
    PACKED: tl.constexpr,
    GROUP: tl.constexpr,
    FP4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < DIM
    row_len: tl.constexpr = FFN // 2 if PACKED else FFN
    groups: tl.constexpr = FFN // GROUP if GROUP > 0 else 1
    tile_group: tl.constexpr = 0 if GROUP == FFN else GROUP  # (as in `_gate_up`)
    span: tl.constexpr = tile_group if (tile_group > 0 and tile_group < BLOCK_K) else BLOCK_K
    G: tl.constexpr = BLOCK_K // span
    W: tl.constexpr = span // 2 if PACKED else span
    acc = tl.zeros([BLOCK_N, G, W], dtype=tl.float32)  # every choice's, weighted
    out = tl.zeros([BLOCK_N], dtype=tl.float32)  # a scale a row: each choice's sum, scaled
    biased = tl.zeros([BLOCK_N], dtype=tl.float32)  # HAS_BIAS: the choices' biases, weighted
    for choice in range(TOP_K):
        pair = token * TOP_K + choice
        expert = tl.load(experts_ptr + pair).to(tl.int64)
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * DIM + rows, mask=row_ok, other=0)
            biased += weight * bias.to(tl.float32)
        w_rows = w2_ptr + expert * (DIM * row_len) + rows[:, None] * row_len  # [BLOCK_N, 1]
        w_scales = scale_ptr + expert * (DIM * groups) + rows[:, None] * groups
        for k0 in range(0, FFN, BLOCK_K):
            # the weight applied to h's values, not to the BLOCK_N · BLOCK_K products
            stored, col_ok = _columns(k0, FFN, PACKED, G, W)
            hs = _inputs(h_ptr + pair * FFN, stored, col_ok, weight, PACKED, FP4)
            ok = row_ok[:, None, None] & col_ok
            acc += _products(
                w_rows, w_scales, hs, stored, ok, k0, row_ok, PACKED, GROUP > 0, tile_group, FP4, G
            )  # fmt: skip
        if GROUP == FFN:
            scale = tl.load(scale_ptr + expert * DIM + rows, mask=row_ok, other=0)
            out += tl.sum(tl.sum(acc, axis=2), axis=1) * _scale(scale, FP4)
            acc = tl.zeros([BLOCK_N, G, W], dtype=tl.float32)
    if GROUP != FFN:
        out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += biased
    tl.store(out_ptr + token * DIM + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def _tile(tile: tuple[int, int, int], length: int) -> tuple[int, int, int]:
    """`tile` on a GPU with BLOCK_K cut to `length`'s power of two (at least 16); the
    interpreter's own tile under the interpreter."""
    if INTERPRETED:
        return INTERPRETED_TILE
    rows, cols, warps = tile
    return rows, max(16, min(cols, triton.next_power_of_2(length))), warps


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    biases: moe.ExpertBiases | None = None,
) -> torch.Tensor:
    """`moe.experts_loop(x, w13, w2, weights, experts)` in two kernels that read only the
    chosen experts' rows: x [tokens, dim], w13 [E, 2I, dim], w2 [E, dim, I], weights and
    experts [tokens, k] -> [tokens, dim] in x's dtype (fp32 sums, h = silu(gate)·up rounded to
    x's dtype between the two). With scales (`moe.QuantizedExperts`' layout: int8, float8 or
    4 bits two a byte, w13_scale [E, 2I, groups], w2_scale [E, dim, groups]; uint8 scales:
    MXFP4) the weights are read quantized and scaled in the kernels. `biases` (gpt-oss): each projection's bias and
    the clamped SwiGLU (`moe.ClampedSwiGLU`) in the kernels too. Any number of tokens;
    `routed_experts` says when it is worth it. CUDA, or Triton's interpreter."""
    tokens, dim = x.shape
    packed = w13.dtype == torch.uint8  # int4, two a byte: the last dimension halved
    ffn = w2.shape[2] * (2 if packed else 1)
    top_k = experts.shape[1]
    assert w13.shape[1:] == (2 * ffn, dim // (2 if packed else 1)) and w2.shape[1] == dim
    assert weights.shape == experts.shape
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights, experts = weights.contiguous(), experts.contiguous()
    scales13, group13 = _scales(w13_scale, dim, w13)
    scales2, group2 = _scales(w2_scale, ffn, w2)
    fp4 = w13_scale is not None and w13_scale.dtype == torch.uint8
    assert _groups_fit(dim, ffn, w13_scale, w2_scale), "groups of scales the tiles cut"
    hidden = x.new_empty(tokens * top_k, ffn)  # [tokens * k, I]: pair p = t * k + s
    b13, b2 = (x, x) if biases is None else (biases.b13.contiguous(), biases.b2.contiguous())
    limit, alpha = _activation(biases)
    block_n, block_k, warps = _tile(GATE_UP_TILE, dim)
    _gate_up[(tokens * top_k, triton.cdiv(ffn, block_n))](
        x, w13, scales13, b13, experts, hidden, DIM=dim, FFN=ffn, TOP_K=top_k, PACKED=packed,
        GROUP=group13, FP4=fp4, HAS_BIAS=biases is not None, LIMIT=limit, ALPHA=alpha, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    block_n, block_k, warps = _tile(DOWN_TILE, ffn)
    _down[(tokens, triton.cdiv(dim, block_n))](
        hidden, w2, scales2, b2, weights, experts, out, DIM=dim, FFN=ffn, TOP_K=top_k,
        PACKED=packed, GROUP=group2, FP4=fp4, HAS_BIAS=biases is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return out


def _activation(biases: moe.ExpertBiases | None) -> tuple[float, float]:
    """The kernels' (LIMIT, ALPHA): gpt-oss's clamped SwiGLU's, (0, 0) for plain SwiGLU."""
    activation = None if biases is None else biases.activation
    if isinstance(activation, moe.ClampedSwiGLU):
        return float(activation.limit), float(activation.alpha)
    assert activation in (None, moe._swiglu), activation
    return 0.0, 0.0


def _scales(scale: torch.Tensor | None, cols: int, weight: torch.Tensor):
    """(a kernel's scale operand, its GROUP): columns a scale covers, 0 without scales."""
    if scale is None:
        return weight, 0
    return scale.contiguous(), cols // scale.shape[-1]


def fused_fits(
    x: torch.Tensor, dtype: torch.dtype, experts: torch.Tensor, quantized: bool = False
) -> bool:
    """Whether `routed_experts` takes the fused kernels: at most `FUSED_PAIRS` pairs
    (`QUANTIZED_FUSED_PAIRS` for `quantized` experts), experts computing in x's (floating)
    dtype (`dtype`: their weights', or quantized, their scales'). The token count is static in
    a CUDA graph, so each graph records one path."""
    return (
        x.shape[0] * experts.shape[1] <= (QUANTIZED_FUSED_PAIRS if quantized else FUSED_PAIRS)
        and dtype == x.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


@triton.jit
def _route(
    logits_ptr,  # [tokens, E]
    weights_ptr,  # [tokens, TOP_K]: the chosen experts' softmax probabilities (NORM: / their sum)
    experts_ptr,  # [tokens, TOP_K] int64
    bias_ptr,  # [E] fp32: added to the probabilities to choose, not to weigh (HAS_BIAS)
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,  # E's power of two
    TOP_K: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,  # TOP_K's power of two
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """A program per token: softmax over its E logits in fp32, then k times the largest score
    (probability, plus the bias) and its index (the first of equals), each taken out before the
    next; a choice weighs its probability."""
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * E + cols, mask=cols < E, other=-float("inf"))
    exps = tl.exp(logits.to(tl.float32) - tl.max(logits.to(tl.float32), axis=0))
    probs = exps / tl.sum(exps, axis=0)
    scores = probs
    if HAS_BIAS:
        scores += tl.load(bias_ptr + cols, mask=cols < E, other=0.0)
    scores = tl.where(cols < E, scores, -float("inf"))  # padding: never chosen
    slots = tl.arange(0, BLOCK_TOP_K)
    chosen = tl.zeros([BLOCK_TOP_K], dtype=tl.float32)
    indices = tl.zeros([BLOCK_TOP_K], dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        index = tl.argmax(scores, axis=0)
        prob = tl.sum(tl.where(cols == index, probs, 0.0), axis=0)
        chosen = tl.where(slots == slot, prob, chosen)
        indices = tl.where(slots == slot, index.to(tl.int64), indices)
        scores = tl.where(cols == index, -float("inf"), scores)
    if NORM:
        chosen = chosen / tl.sum(chosen, axis=0)
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, chosen.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(experts_ptr + out, indices, mask=slots < TOP_K)


@torch.library.custom_op("lmforge::route", mutates_args=())
def route(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one kernel for at most `FUSED_PAIRS` (token, choice) pairs (a decode
    step's: there torch's softmax, top-k and its sort took 10.6 µs of a 30B-A3B layer's ~89 on
    an H100, 2026-12-07, docs/benchmarks.md), else `moe.route` itself. The k come largest first. The
    token count is read at run time, as in `routed_experts`."""
    tokens, num_experts = logits.shape
    if tokens * top_k > FUSED_PAIRS:
        return moe.route(logits, top_k, norm_topk_prob=norm_topk_prob, expert_bias=expert_bias)
    weights = logits.new_empty(tokens, top_k)
    experts = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    has_bias = expert_bias is not None
    _route[(tokens,)](
        logits.contiguous(), weights, experts, expert_bias if has_bias else logits,
        E=num_experts, BLOCK_E=triton.next_power_of_2(num_experts), TOP_K=top_k,
        BLOCK_TOP_K=triton.next_power_of_2(top_k), NORM=norm_topk_prob, HAS_BIAS=has_bias,
        num_warps=1,
    )  # fmt: skip
    return weights, experts


@route.register_fake
def _(logits, top_k, norm_topk_prob, expert_bias=None):
    tokens = logits.shape[0]
    experts = logits.new_empty(tokens, top_k, dtype=torch.int64)
    return logits.new_empty(tokens, top_k), experts


@torch.library.custom_op("lmforge::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    grouped: bool | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    limit: float = 0.0,
    alpha: float = 0.0,
) -> torch.Tensor:
    """x [tokens, dim] through its chosen experts -> [tokens, dim]: `fused_experts` where
    `fused_fits`, else `moe.expert_outputs` (`grouped` as there; quantized experts, with their
    scales, dequantized first; with biases `b13`, `b2`, and `limit` > 0 gpt-oss's clamped
    SwiGLU of `alpha`). An opaque op to torch.compile: the engine compiles one decode
    step for every batch bucket above 1 (a dynamic batch dimension), and a branch on the token
    count in the traced code would be a guard that dimension's range refuses; here the count
    is an int, read at run time."""
    biases = None
    if b13 is not None:
        activation = moe.ClampedSwiGLU(alpha, limit) if limit > 0 else moe._swiglu
        biases = moe.ExpertBiases(b13, b2, activation)
    dtype = w13.dtype if w13_scale is None else w13_scale.dtype
    if dtype == torch.uint8:  # MXFP4's scales: computing in x's dtype
        dtype = x.dtype
    ffn = w2.shape[2] * (2 if w13.dtype == torch.uint8 else 1)
    quantized = w13_scale is not None
    fits = fused_fits(x, dtype, experts, quantized)
    if fits and _groups_fit(x.shape[1], ffn, w13_scale, w2_scale):
        return fused_experts(x, w13, w2, weights, experts, w13_scale, w2_scale, biases)
    if quantized:
        w13, w2 = moe.dequantize(w13, w13_scale, x.dtype), moe.dequantize(w2, w2_scale, x.dtype)
    return moe.expert_outputs(x, w13, w2, weights, experts, grouped=grouped, biases=biases)


@routed_experts.register_fake
def _(x, w13, w2, weights, experts, grouped=None, w13_scale=None, w2_scale=None, b13=None,
      b2=None, limit=0.0, alpha=0.0):  # fmt: skip
    return torch.empty_like(x)


class FusedExperts(moe.Experts):
    """A MoE block's stacked experts (`moe.Experts`, same parameters and names) whose forward
    without autograd goes through `routed_experts` (the fused kernels for a few tokens), on
    CUDA or under the interpreter; with autograd, or elsewhere, `moe.Experts`'s own. Installed
    by `use_fused_experts`, which swaps the module's class, as `use_fused_blocks` does."""

    def forward(self, x, weights, experts) -> torch.Tensor:
        if not _inference_kernels(x):
            return super().forward(x, weights, experts)
        return routed_experts(x, self.w13, self.w2, weights, experts, self.grouped)


class FusedQuantizedExperts(moe.QuantizedExperts):
    """`moe.QuantizedExperts` whose forward without autograd goes through `routed_experts`
    with the scales (and biases): for a few tokens the fused kernels read the quantized weights
    (a quarter or half of bf16's bytes), for more the stacks are dequantized for the grouped
    path."""

    def forward(self, x, weights, experts) -> torch.Tensor:
        if not _inference_kernels(x):
            return super().forward(x, weights, experts)
        biases = self.biases()
        limit, alpha = _activation(biases)
        b13, b2 = (None, None) if biases is None else (biases.b13, biases.b2)
        return routed_experts(
            x, self.w13, self.w2, weights, experts, self.grouped, self.w13_scale, self.w2_scale,
            b13, b2, limit, alpha,
        )  # fmt: skip


class FusedBiasedExperts(moe.BiasedExperts):
    """`moe.BiasedExperts` (gpt-oss's) whose forward without autograd goes through
    `routed_experts` with the biases and the clamped SwiGLU: the fused kernels for a few
    tokens, as for `FusedExperts`."""

    def forward(self, x, weights, experts) -> torch.Tensor:
        if not _inference_kernels(x):
            return super().forward(x, weights, experts)
        limit, alpha = _activation(moe.ExpertBiases(self.b13, self.b2, self.activation))
        return routed_experts(
            x, self.w13, self.w2, weights, experts, self.grouped, None, None, self.b13, self.b2,
            limit, alpha,
        )  # fmt: skip


class FusedRouting(moe.MoEFeedForward):
    """A sparse MLP whose routing without autograd, on CUDA or under the interpreter, is one
    kernel for a few tokens (`route`); installed by `use_fused_experts`."""

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not _inference_kernels(logits):
            return super().route(logits)
        return route(logits, self.top_k, self.norm_topk_prob, self.expert_bias)


def _inference_kernels(x: torch.Tensor) -> bool:
    """Whether these kernels take a forward on x: without autograd, on CUDA or the interpreter."""
    return not torch.is_grad_enabled() and (x.is_cuda or INTERPRETED)


def use_fused_experts(model: nn.Module) -> int:
    """Make every `moe.Experts` of `model` over plain weights a `FusedExperts` (gpt-oss's
    `moe.BiasedExperts` a `FusedBiasedExperts`, a quantized artifact's `moe.QuantizedExperts` a
    `FusedQuantizedExperts`), and every softmax-top-k sparse MLP a `FusedRouting`; returns how
    many experts were swapped. Passed by: LoRA's experts
    (`LoRAExperts`, another class: their adapters run in the model's paths), expert
    parallelism's (a class of its own, DTensor weights) and modules with hooks."""
    swapped = 0
    for module in model.modules():
        hooked = bool(module._forward_hooks or module._forward_pre_hooks)
        plain = (
            type(module) is moe.Experts
            and not hooked
            and all(type(p.data) is torch.Tensor for p in (module.w13, module.w2))
        )
        biased = (
            type(module) is moe.BiasedExperts
            and not hooked
            and all(type(p.data) is torch.Tensor for p in module.parameters())
        )
        if plain or biased or (type(module) is moe.QuantizedExperts and not hooked):
            module.__class__ = (
                FusedExperts if plain else FusedBiasedExperts if biased else FusedQuantizedExperts
            )
            swapped += 1
        elif type(module) is moe.MoEFeedForward and not module._forward_pre_hooks:
            module.__class__ = FusedRouting
    return swapped
