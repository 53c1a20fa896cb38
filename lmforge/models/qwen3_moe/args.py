"""Qwen3-MoE hyperparameters and the named presets.

Qwen3's dense fields (head_dim, q/k head norms, RoPE theta 1e6, vocab 151936) plus the sparse
MLP's: `num_experts` SwiGLU experts of width `moe_ffn_dim` (HF `moe_intermediate_size`), the
top `num_experts_per_tok` of them per token, their weights renormalized when `norm_topk_prob`;
balanced by the auxiliary loss (`router_aux_loss_coef`) and/or DeepSeek-V3's selection bias
(`router_bias_update`).
A block is sparse when its index is not in `mlp_only_layers` and (index + 1) is a multiple of
`decoder_sparse_step` (transformers' rule); the others are dense with `ffn_dim`
(`intermediate_size`). The presets match the published config.json of Qwen3-30B-A3B and
Qwen3-235B-A22B (every block sparse, untied, 40960 positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmforge.errors import ConfigError
from lmforge.models.qwen3.args import ModelArgs as Qwen3Args


@dataclass(kw_only=True, frozen=True)
class ModelArgs(Qwen3Args):
    """Qwen3's fields plus the experts' (defaults: transformers' Qwen3MoeConfig)."""

    family: ClassVar[str] = "qwen3_moe"

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_ffn_dim: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    # DeepSeek-V3's auxiliary-loss-free balancing: each step, every expert's selection bias
    # moves by this much against its load (0: off, no bias; DeepSeek-V3 used 0.001)
    router_bias_update: float = 0.0

    # fields a loaded model may change (`model.overrides`): how it trains, not its shapes
    training_fields: ClassVar[tuple[str, ...]] = ("router_aux_loss_coef", "router_bias_update")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.mlp_only_layers, list):  # from a config file: hashable like the rest
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for name in ("num_experts", "num_experts_per_tok", "moe_ffn_dim", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"model {name}={value!r} must be an integer")
            if value <= 0:
                raise ConfigError(f"model {name}={value} must be > 0")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"model num_experts_per_tok={self.num_experts_per_tok} must be <= "
                f"num_experts={self.num_experts}"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"model norm_topk_prob={self.norm_topk_prob!r} must be true or false")
        if not isinstance(self.mlp_only_layers, tuple) or not all(
            isinstance(i, int) and 0 <= i < self.num_layers for i in self.mlp_only_layers
        ):
            raise ConfigError(
                f"model mlp_only_layers={self.mlp_only_layers!r} must list layer indices in "
                f"0..{self.num_layers - 1}"
            )
        for name in ("router_aux_loss_coef", "router_bias_update"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ConfigError(f"model {name}={value!r} must be a number >= 0")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` is sparse (transformers' Qwen3MoeDecoderLayer rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [layer for layer in range(self.num_layers) if self.is_moe_layer(layer)]

    def mlp_params(self, layer: int, *, active: bool = False) -> int:
        """A sparse block's router [E, dim] and experts (the chosen k when `active`); a dense
        block's SwiGLU of ffn_dim."""
        if not self.is_moe_layer(layer):
            return super().mlp_params(layer, active=active)
        experts = self.num_experts_per_tok if active else self.num_experts
        return self.num_experts * self.dim + experts * 3 * self.dim * self.moe_ffn_dim


PRESETS: dict[str, ModelArgs] = {
    "qwen3-30b-a3b": ModelArgs(
        dim=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        ffn_dim=6144,
        moe_ffn_dim=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    ),
    "qwen3-235b-a22b": ModelArgs(
        dim=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        ffn_dim=12288,
        moe_ffn_dim=1536,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    ),
}
