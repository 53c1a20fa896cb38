"""The Qwen3-MoE transformer: Qwen3's blocks (lmforge/models/qwen3/model.py) whose MLP is, in the
sparse layers (`ModelArgs.is_moe_layer`), a router over stacked SwiGLU experts
(lmforge/models/moe.py); the other layers keep the dense SwiGLU. The forward's arguments are
Llama's. In training mode each sparse MLP keeps its last router logits, from which `aux_loss`
makes the load-balancing loss that the training loop adds to every method's loss, and
`expert_counts` the experts' load it logs (train/loop.py asks any model for both).
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.models.moe import MoEFeedForward, expert_counts, load_balancing_loss
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
            expert_bias=a.router_bias_update > 0,
        )

    def _moe_blocks(self) -> dict[int, MoEFeedForward]:
        # (a block may be wrapped for activation checkpointing: modules() sees through it)
        found = {}
        for index, block in self.layers.items():
            for module in block.modules():
                if isinstance(module, MoEFeedForward):
                    found[int(index)] = module
        return found

    def router_logits(self) -> tuple[torch.Tensor, ...]:
        """The last training-mode forward's router logits, one [b·s, E] a sparse layer."""
        return tuple(mlp.router_logits for mlp in self._moe_blocks().values())

    def expert_counts(self) -> dict[int, torch.Tensor]:
        """Sparse layer index -> [E] fp32: the top-k choices each expert got in the last
        training-mode forward (all zeros before one)."""
        a = self.args
        counts = {}
        for layer, mlp in self._moe_blocks().items():
            if mlp.router_logits is None:
                counts[layer] = torch.zeros(a.num_experts, device=mlp.router.weight.device)
            else:
                counts[layer] = expert_counts(
                    mlp.router_logits, a.num_experts_per_tok, mlp.expert_bias
                )
        return counts

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        """DeepSeek-V3's bias step on every sparse layer from the step's top-k counts (sparse
        layer index -> [E], every micro-batch and rank summed; `expert_counts`' keys); nothing
        when `router_bias_update` is 0. The training loop calls it once a step, after the
        update, with the same all-reduced counts on every rank."""
        rate = self.args.router_bias_update
        if rate > 0:
            for layer, mlp in self._moe_blocks().items():
                mlp.update_expert_bias(counts[layer], rate)

    def aux_loss(self, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """router_aux_loss_coef × the load-balancing loss of the last training-mode forward
        (`attention_mask` [b, s]: 0 for padding rows)."""
        a = self.args
        logits = self.router_logits()
        if not logits:  # every layer dense (mlp_only_layers): nothing to balance
            return torch.zeros((), device=self.tok_embeddings.weight.device)
        if any(layer is None for layer in logits):
            raise RuntimeError("aux_loss needs a forward in training mode first")
        biases = [mlp.expert_bias for mlp in self._moe_blocks().values()]
        loss = load_balancing_loss(
            logits, a.num_experts, a.num_experts_per_tok, attention_mask, biases
        )
        return a.router_aux_loss_coef * loss
