"""The gpt-oss transformer: Llama's residual blocks and RMSNorm with
- attention projections with biases, a learned sink logit a head (a softmax column whose value
  adds to the denominator only), and every other block attending within a sliding window;
- a sparse MLP in every block: a router with a bias, the top k of its logits softmaxed among
  themselves (Qwen3-MoE's routing with norm_topk_prob: the same weights), experts with biases
  and the clamped SwiGLU (`moe.BiasedExperts`);
- YaRN-scaled RoPE (its inverse frequencies, and cos and sin times its attention factor).

The sink rides along in `F.scaled_dot_product_attention` as one more key: a zero key and value
whose score is the head's sink (q · 0 + the mask's value), so it enters each row's softmax
denominator and adds nothing to the output, on every backend that takes a float mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.gpt_oss.args import ModelArgs
from lmforge.models.llama.model import Attention, rope_cos_sin
from lmforge.models.llama.model import Transformer as LlamaTransformer
from lmforge.models.moe import BiasedExperts, ClampedSwiGLU, MoEFeedForward, SparseModel


def yarn_frequencies(args: ModelArgs) -> torch.Tensor:
    """YaRN's inverse frequencies [head_dim // 2] (Peng et al., 2023): rotations slower than
    `beta_slow` per original context are interpolated by `factor`, faster than `beta_fast`
    kept, a linear ramp between (no `yarn`: RoPE's own)."""
    yarn, dim, base = args.yarn, args.head_dim, args.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    kept = 1.0 / base**exponents
    if yarn is None:
        return kept

    def dimension(rotations: float) -> float:  # the frequency index that turns `rotations`
        return (
            dim
            * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = dimension(yarn.beta_fast), dimension(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low or 0.001)
    kept_share = 1 - ramp.clamp(0, 1)
    return kept / yarn.factor * (1 - kept_share) + kept * kept_share


def yarn_attention_factor(args: ModelArgs) -> float:
    """YaRN's factor on cos and sin (so on the attention logits): 0.1 · ln(factor) + 1."""
    factor = args.yarn.factor if args.yarn is not None else 1.0
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def within_window(allowed: torch.Tensor, window: int) -> torch.Tensor:
    """A bool mask [..., s, L] (True: attend) narrowed to the last `window` keys each query may
    attend to, its own the last of them: counted among the allowed keys, not by index, so a
    row that packs a context and several continuations after it (`shared_context_logprobs`)
    windows each continuation by its positions; for a causal or per-document mask the two
    counts are the same."""
    from_the_end = allowed.flip(-1).cumsum(-1).flip(-1)  # allowed keys at or after each key
    return allowed & (from_the_end <= window)


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter as this process's part: under tensor parallelism in training the sinks are
    a DTensor split by head (plan.py), the heads of q this rank's."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


class SinkAttention(Attention):
    """gpt-oss's attention: biased projections, `sinks` [heads] (each head's sink logit) and,
    where `window` is set, a sliding window of that many tokens."""

    def __init__(self, args: ModelArgs, window: int | None) -> None:
        super().__init__(args, bias=True)
        self.window = window
        self.sinks = nn.Parameter(torch.empty(args.num_heads))

    def scores(self, q, k, v, attn_mask=None) -> torch.Tensor:
        """Llama's `scores` with the window and the sinks (q [b, heads, s, hd], k and v [b,
        kv_heads, keys, hd])."""
        batch, heads, seq, _ = q.shape
        allowed = attn_mask
        if allowed is None:  # causal; the queries are the last `seq` of the keys
            keys = k.shape[2]
            allowed = torch.ones(seq, keys, dtype=torch.bool, device=q.device).tril(keys - seq)
        if self.window is not None:
            allowed = within_window(allowed, self.window)
        sink_key = k.new_zeros(*k.shape[:2], 1, self.head_dim)  # [b, kv_heads, 1, hd]
        k, v = torch.cat([k, sink_key], dim=2), torch.cat([v, sink_key], dim=2)
        scores = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        scores = scores.masked_fill(~allowed, float("-inf")).expand(batch, heads, seq, -1)
        sink = _local(self.sinks).to(q.dtype).view(1, heads, 1, 1).expand(batch, heads, seq, 1)
        mask = torch.cat([scores, sink], dim=-1)  # [b, heads, s, keys + 1]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_groups > 1
        )

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        nn.init.zeros_(self.sinks)


class Transformer(SparseModel, LlamaTransformer):
    """tokens [batch, seq] (int64) -> logits [batch, seq, vocab]; every block's attention holds
    wq/wk/wv/wo with biases and sinks [heads], its feed_forward router.weight [E, dim] with
    router.bias [E], experts.w13 [E, 2·ffn_dim, dim], experts.b13, experts.w2 [E, dim, ffn_dim]
    and experts.b2."""

    args: ModelArgs

    def block_attention(self, layer: int) -> Attention:
        return SinkAttention(self.args, window=self.args.window(layer))

    def block_feed_forward(self, layer: int) -> nn.Module:
        a = self.args
        activation = ClampedSwiGLU(alpha=a.swiglu_alpha, limit=a.swiglu_limit)
        experts = BiasedExperts(a.dim, a.ffn_dim, a.num_experts, activation)
        # gpt-oss softmaxes the top k of the router's logits among themselves: the top k of the
        # softmax over all E, renormalized (softmax is monotonic, and the top logit is the
        # largest of all), so the routing is Qwen3-MoE's with norm_topk_prob (its kernel too)
        return MoEFeedForward(
            a.dim, a.ffn_dim, a.num_experts, a.num_experts_per_tok, norm_topk_prob=True,
            router_bias=True, experts=experts,
        )  # fmt: skip

    def rope_frequencies(self) -> torch.Tensor:
        return yarn_frequencies(self.args)

    def rope_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin times YaRN's attention factor, scaled in fp32 and then rounded."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, torch.float32)
        factor = yarn_attention_factor(self.args)
        return (cos * factor).to(dtype), (sin * factor).to(dtype)
