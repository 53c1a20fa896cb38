"""Attention of decoding rows (one new token each) against the static KV cache, in Triton:
RoPE of the new query and key, the new key and value written into the cache, and attention
over the row's slots 0..position, in one kernel.

In the batch-1 step (`FusedDecodeBlock`) this replaces four kernels a layer: inductor's RoPE
of q (fused with the attention mask), RoPE of k with its cache write, the cache write of v,
and cuDNN's attention. On an H200 those took ~10 us a layer of the 1B's step (cuDNN 6 us of
it); this kernel 4.9 us with one program a key/value head (docs/benchmarks.md).

Work split: one program per (row, key/value head, split of the slots). A program computes
its group's query heads at once (the GQA group is the rows of a tile), reads its split's
cached keys and values in blocks, and keeps the online softmax's running max, sum and
weighted values. The new token's key and value never pass through the cache inside the
kernel: the program whose split holds the row's position takes them from the projections (in
registers) and writes them to the cache for later steps, so no program reads a slot another
writes. With one split the program normalizes and stores the output; with more, each stores
its part (max, sum, weighted values) and `_combine` merges them. At 143 slots of the 1B on an
H200, one split a head took 0.078 ms a step; 64 slots a program (3 splits) 0.048 ms and the
merge kernel 0.021; merging in the kernel instead (the last split of a group, after a count on
an atomic counter) 0.092 ms, its merge a serial tail. So up to 256 slots a program, one split.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lmforge.generate.early_launch import INTERPRETED, early_launch, wait_for_previous

SPLIT_SLOTS = 256  # cache slots a program reads at least (more slots: more programs)
MAX_SPLITS = 32  # programs a row and head at most (more slots: more slots a program)
BLOCK_SLOTS = 64  # slots a loop step reads
GROUP_ROWS = 16  # the query heads of a GQA group, padded to a tile's least rows (tl.dot)
# Triton's interpreter (the tests) multiplies bf16 tiles wrongly: there the dots take float32.
FLOAT32_DOTS = INTERPRETED


@triton.jit
def _rope(ptr, at, rotated_at, cos, sin, sign, norm_ptr, d, rotated, eps, NORM: tl.constexpr):
    """x * cos + rotate_half(x) * sin for heads x at `ptr + at` ([..., HEAD_DIM]; rotate_half:
    the halves swapped, the first negated: `rotated_at` indexes the swapped halves, `sign` is
    -1 over the first). NORM: x is first each head's RMSNorm with weight `norm_ptr` (Qwen3's
    q_norm / k_norm), in fp32."""
    x = tl.load(ptr + at).to(tl.float32)
    x_rotated = tl.load(ptr + rotated_at).to(tl.float32)
    if NORM:
        inverse_rms = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / x.shape[-1] + eps)
        x = x * inverse_rms * tl.load(norm_ptr + d).to(tl.float32)
        x_rotated = x_rotated * inverse_rms * tl.load(norm_ptr + rotated).to(tl.float32)
    return x * cos + sign * x_rotated * sin


@triton.jit
def _dot(a, b, EXACT: tl.constexpr):
    """a @ b in float32, from the inputs' dtype or (EXACT) from float32 without tf32."""
    if EXACT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _decode_attention(
    qkv_ptr,  # [b, (heads + 2 * kv_heads) * head_dim]: q, k, v of the new token, before RoPE
    cos_ptr,  # [b, head_dim]
    sin_ptr,
    k_cache_ptr,  # [max_b, kv_heads, max_seq_len, head_dim]
    v_cache_ptr,
    positions_ptr,  # [b]: the new token's slot
    out_ptr,  # [b, heads * head_dim]
    partial_ptr,  # [b, heads, splits, head_dim] float32 (several splits)
    stats_ptr,  # [b, heads, splits, 2] float32: running max (log2 units), sum
    q_norm_ptr,  # [HEAD_DIM] (QK_NORM)
    k_norm_ptr,
    eps,  # the q / k norms' (QK_NORM)
    qkv_row_stride,
    cache_row_stride,
    cache_head_stride,
    split_slots,  # cache slots a program reads at most
    splits,
    scale,  # log2(e) / sqrt(head_dim)
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr,
    EXACT: tl.constexpr,  # float32 dots (a float32 cache; the interpreter)
    EARLY: tl.constexpr,  # launched early (early_launch.py): wait for the kernel before
    QK_NORM: tl.constexpr = False,  # each q and k head RMSNormed before RoPE (Qwen3)
):
    wait_for_previous(EARLY)
    row_head, split = tl.program_id(0), tl.program_id(1)
    row, kv_head = row_head // KV_HEADS, row_head % KV_HEADS
    group: tl.constexpr = HEADS // KV_HEADS
    position = tl.load(positions_ptr + row)
    d = tl.arange(0, HEAD_DIM)
    rotated = (d + HEAD_DIM // 2) % HEAD_DIM
    sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
    cos = tl.load(cos_ptr + row * HEAD_DIM + d).to(tl.float32)
    sin = tl.load(sin_ptr + row * HEAD_DIM + d).to(tl.float32)
    g = tl.arange(0, GROUP_ROWS)
    heads_at = (kv_head * group + tl.minimum(g, group - 1))[:, None] * HEAD_DIM  # padded: repeats
    qkv = qkv_ptr + row * qkv_row_stride
    q = _rope(qkv, heads_at + d[None, :], heads_at + rotated[None, :], cos, sin, sign,
              q_norm_ptr, d, rotated, eps, QK_NORM)  # fmt: skip
    dtype = k_cache_ptr.dtype.element_ty
    q = q.to(dtype)  # [GROUP_ROWS, HEAD_DIM], as the cache's keys: the dots' inputs
    head_at = row.to(tl.int64) * cache_row_stride + kv_head * cache_head_stride  # (> 2^31)
    k_cache, v_cache = k_cache_ptr + head_at, v_cache_ptr + head_at

    top = tl.full([GROUP_ROWS], float("-inf"), tl.float32)  # running max of the scores
    total = tl.zeros([GROUP_ROWS], tl.float32)  # running sum of exp2(score - top)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    start = split * split_slots
    end = tl.minimum(start + split_slots, position)  # cached slots [start, end)
    for first in range(start, end, BLOCK_SLOTS):
        slots = first + tl.arange(0, BLOCK_SLOTS)
        ok = slots < end
        at = slots[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_cache + at, mask=ok[:, None], other=0.0)  # [BLOCK_SLOTS, HEAD_DIM]
        scores = _dot(q, tl.trans(k), EXACT) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))  # [GROUP_ROWS, BLOCK_SLOTS]
        new_top = tl.maximum(top, tl.max(scores, 1))
        weights = tl.exp2(scores - new_top[:, None])
        decay = tl.exp2(top - new_top)
        total = total * decay + tl.sum(weights, 1)
        v = tl.load(v_cache + at, mask=ok[:, None], other=0.0)
        acc = acc * decay[:, None] + _dot(weights.to(dtype), v, EXACT)
        top = new_top

    # The split that holds the new token's slot takes it (a row at kv_len or beyond, whose
    # output the engine ignores, still writes its slot: the last split does).
    if tl.minimum(position // split_slots, splits - 1) == split:
        k_at = (HEADS + kv_head) * HEAD_DIM
        k = _rope(qkv, k_at + d, k_at + rotated, cos, sin, sign, k_norm_ptr, d, rotated, eps,
                  QK_NORM).to(dtype)  # fmt: skip
        v = tl.load(qkv + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + d).to(dtype)
        tl.store(k_cache + position * HEAD_DIM + d, k)
        tl.store(v_cache + position * HEAD_DIM + d, v)
        score = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale
        new_top = tl.maximum(top, score)
        weight = tl.exp2(score - new_top)
        decay = tl.exp2(top - new_top)
        total = total * decay + weight
        acc = acc * decay[:, None] + weight[:, None] * v.to(tl.float32)[None, :]
        top = new_top

    heads = row * HEADS + kv_head * group + g  # [GROUP_ROWS]; rows >= group are padding
    real = g < group
    if splits == 1:
        out = acc / total[:, None]
        tl.store(out_ptr + heads[:, None] * HEAD_DIM + d[None, :], out, mask=real[:, None])
    else:
        at = heads * splits + split
        tl.store(partial_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=real[:, None])
        tl.store(stats_ptr + 2 * at, top, mask=real)
        tl.store(stats_ptr + 2 * at + 1, total, mask=real)


@triton.jit
def _combine(
    partial_ptr,
    stats_ptr,
    out_ptr,
    splits,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    EARLY: tl.constexpr,
):
    """One (row, head): the splits' parts weighed by their running maxima."""
    wait_for_previous(EARLY)
    head = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    ok = s < splits
    at = head * splits + s
    top = tl.load(stats_ptr + 2 * at, mask=ok, other=float("-inf"))
    total = tl.load(stats_ptr + 2 * at + 1, mask=ok, other=0.0)
    weight = tl.where(ok, tl.exp2(top - tl.max(top, 0)), 0.0)  # a split of no slots: 0
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(partial_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.sum(weight * total, 0)
    tl.store(out_ptr + head * HEAD_DIM + d, out)


def supported(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes the kernel takes: a power-of-two head_dim of at least 16, GQA groups that fit a
    tile."""
    group = heads // kv_heads
    power_of_two = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return power_of_two and heads % kv_heads == 0 and group <= GROUP_ROWS


@torch.library.custom_op("lmforge::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_len: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Decoding rows' attention: qkv [b, (heads + 2 * kv_heads) * head_dim] (one new token a
    row, before RoPE), cos / sin [b, head_dim], the caches [max_b, kv_heads, max_seq_len,
    head_dim], positions [b] (each row's new slot, < kv_len) -> [b, heads * head_dim]. The new
    keys (after RoPE) and values are written into the caches; each row attends to its slots
    0..position (the slots beyond may hold stale values: never read). `q_norm` / `k_norm`
    [head_dim] with `eps`: each query and key head RMSNormed before RoPE (Qwen3)."""
    batch = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    out = qkv.new_empty(batch, heads * head_dim)
    # At least SPLIT_SLOTS slots a program, and at most MAX_SPLITS programs a row and head.
    blocks = max(
        triton.cdiv(SPLIT_SLOTS, BLOCK_SLOTS), triton.cdiv(kv_len, BLOCK_SLOTS * MAX_SPLITS)
    )
    split_slots = blocks * BLOCK_SLOTS
    splits = triton.cdiv(kv_len, split_slots)
    partial = stats = out  # (any pointer where unused)
    early = early_launch(qkv.device)
    if splits > 1:
        partial = qkv.new_empty(batch, heads, splits, head_dim, dtype=torch.float32)
        stats = qkv.new_empty(batch, heads, splits, 2, dtype=torch.float32)
    _decode_attention[(batch * kv_heads, splits)](
        qkv.contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        k_cache,
        v_cache,
        positions.contiguous(),
        out,
        partial,
        stats,
        q_norm if q_norm is not None else out,  # (any pointer where unused)
        k_norm if k_norm is not None else out,
        eps,
        qkv.shape[-1],
        k_cache.stride(0),
        k_cache.stride(1),
        split_slots,
        splits,
        math.log2(math.e) / math.sqrt(head_dim),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        GROUP_ROWS=GROUP_ROWS,
        BLOCK_SLOTS=BLOCK_SLOTS,
        EXACT=k_cache.dtype == torch.float32 or FLOAT32_DOTS,
        EARLY=early,
        QK_NORM=q_norm is not None,
        num_warps=4,
        num_stages=2,
        launch_pdl=early,
    )
    if splits > 1:
        block = triton.next_power_of_2(splits)
        _combine[(batch * heads,)](
            partial,
            stats,
            out,
            splits,
            HEAD_DIM=head_dim,
            SPLITS=block,
            EARLY=early,
            launch_pdl=early,
        )
    return out


@decode_attention.register_fake
def _(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_len, q_norm=None, k_norm=None,
      eps=0.0):  # fmt: skip
    return qkv.new_empty(qkv.shape[0], heads * k_cache.shape[3])
