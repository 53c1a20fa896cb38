"""The Qwen3-MoE transformer: Qwen3's blocks (lmforge/models/qwen3/model.py) whose MLP is, in the
sparse layers (`ModelArgs.is_moe_layer`), a router over stacked SwiGLU experts
(lmforge/models/moe.py); the other layers keep the dense SwiGLU. The forward's arguments are
Llama's. In training mode each sparse MLP keeps its last router logits, from which `aux_loss`
makes the load-balancing loss for a training loss to add (train/'s loss steps do not add it yet).
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.models.moe import MoEFeedForward, load_balancing_loss
from lmforge.models.qwen3.model import Transformer as Qwen3Transformer
from lmforge.models.qwen3_moe.args import ModelArgs


class Transformer(Qwen3Transformer):
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
        )

    def router_logits(self) -> tuple[torch.Tensor, ...]:
        """The last training-mode forward's router logits, one [b·s, E] a sparse layer."""
        mlps = [block.feed_forward for block in self.layers.values()]
        return tuple(mlp.router_logits for mlp in mlps if isinstance(mlp, MoEFeedForward))

    def aux_loss(self, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """router_aux_loss_coef × the load-balancing loss of the last training-mode forward
        (`attention_mask` [b, s]: 0 for padding rows)."""
        a = self.args
        logits = self.router_logits()
        if not logits or any(layer is None for layer in logits):
            raise RuntimeError("aux_loss needs a forward in training mode first")
        loss = load_balancing_loss(logits, a.num_experts, a.num_experts_per_tok, attention_mask)
        return a.router_aux_loss_coef * loss
