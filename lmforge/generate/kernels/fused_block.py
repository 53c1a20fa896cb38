"""The batch-1 decode block as four GEMV launches around one attention kernel
(`FusedDecodeBlock`, installed by `use_fused_blocks`): each RMSNorm, SiLU·up and residual add
inside the product that reads or writes it, and RoPE with the cache write inside the attention
kernel (`lmforge.generate.decode_attention`), whose one row of attention `_attend_one_row`
routes.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from lmforge.generate.decode_attention import decode_attention, supported
from lmforge.generate.kernels.layers import _MatvecLayer
from lmforge.generate.kernels.ops import one_row
from lmforge.modules.kv_cache import StaticKVCache

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
    (torch.profiler; docs/benchmarks.md). A sparse block (a Mixture-of-Experts' router and
    experts) fuses its attention half, and its MLP runs its own forward (the fused experts of
    kernels/moe.py). More rows take the block's own forward. A mixin:
    `use_fused_blocks` swaps a block's class for one deriving from this and the family's own
    block class, so names and the state dict stay."""

    def forward(self, x, cos, sin, attn_mask=None, kv_cache=None):
        if not one_row(x):
            return super().forward(x, cos, sin, attn_mask, kv_cache)
        attention, ffn = self.attention, self.feed_forward
        qkv = attention.wqkv.matvec(x, norm=self.attention_norm)
        heads = _attend_one_row(attention, qkv, cos, sin, attn_mask, kv_cache)
        h = attention.wo.matvec(heads, residual=x)
        if not _dense(ffn):  # a sparse MLP (router and experts): its own forward
            return h + ffn(self.ffn_norm(h))
        gated = ffn.w13.matvec(h, norm=self.ffn_norm, swiglu=SWIGLU_IN_W13)
        return ffn.w2.matvec(gated, gated=True, residual=h)


def _dense(ffn: nn.Module) -> bool:
    return hasattr(ffn, "w13")


def _attend_one_row(attention: nn.Module, qkv, cos, sin, attn_mask, kv_cache) -> torch.Tensor:
    """A decoding row's attention of its fused projections qkv [1, 1, ...] -> [1, 1, heads *
    head_dim]: RoPE, the cache write and attention in one kernel (`decode_attention`) against
    a decode step's static cache (Qwen3's per-head norms of q and k in it too); otherwise (a prefill's view of the
    cache, no cache, shapes the kernel does not take) the model's own `attend`."""
    heads = attention.fused_sizes[0] // attention.head_dim
    if isinstance(kv_cache, StaticKVCache) and supported(
        heads, kv_cache.k.shape[1], attention.head_dim
    ):
        q_norm, k_norm = attention.q_norm, attention.k_norm  # (Qwen3's; None: Llama's)
        return decode_attention(
            qkv.view(1, -1),
            cos.view(1, -1),
            sin.view(1, -1),
            kv_cache.k,
            kv_cache.v,
            kv_cache.positions.view(1),
            heads,
            kv_cache.kv_len,
            q_norm=q_norm.weight if q_norm is not None else None,
            k_norm=k_norm.weight if k_norm is not None else None,
            eps=q_norm.eps if q_norm is not None else 0.0,
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
        # A sparse MLP (router and stacked experts, no w13): the attention half alone
        linears = (attention.wqkv, attention.wo)
        linears += (ffn.w13, ffn.w2) if _dense(ffn) else ()
        if not isinstance(block, FusedDecodeBlock) and all(
            isinstance(linear, _MatvecLayer) for linear in linears
        ):
            block.__class__ = _fused_class(type(block))
            fused += 1
    return fused
