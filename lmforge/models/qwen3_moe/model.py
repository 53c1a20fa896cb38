"""The Qwen3-MoE transformer: Qwen3's blocks (lmforge/models/qwen3/model.py) whose MLP is, in the
sparse layers (`ModelArgs.is_moe_layer`), a router over stacked SwiGLU experts
(lmforge/models/moe.py); the other layers keep the dense SwiGLU. The forward's arguments are
Llama's. The load-balancing loss, the experts' load and DeepSeek-V3's bias step are
`SparseModel`'s (lmforge/models/moe.py), shared with gpt-oss.
"""

from __future__ import annotations

from torch import nn

from lmforge.models.moe import MoEFeedForward, SparseModel
from lmforge.models.qwen3.model import Transformer as Qwen3Transformer
from lmforge.models.qwen3_moe.args import ModelArgs


class Transformer(SparseModel, Qwen3Transformer):
    """tokens [batch, seq] (int64) -> logits [batch, seq, vocab]; a sparse block's
    feed_forward holds router.weight [E, dim], experts.w13 [E, 2·moe_ffn_dim, dim] and
    experts.w2 [E, dim, moe_ffn_dim]."""

    args: ModelArgs

    def block_feed_forward(self, layer: int) -> nn.Module:
        a = self.args
        if not a.is_moe_layer(layer):
            return super().block_feed_forward(layer)
        return MoEFeedForward(
            a.dim,
            a.moe_ffn_dim,
            a.num_experts,
            a.num_experts_per_tok,
            norm_topk_prob=a.norm_topk_prob,
            expert_bias=a.router_bias_update > 0,
        )
