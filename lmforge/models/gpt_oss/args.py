"""gpt-oss hyperparameters and the named presets.

Every block is sparse: `num_experts` experts of width `ffn_dim` (HF `intermediate_size`) with
biases and the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`), the top `num_experts_per_tok`
of the router's logits (a linear with a bias) softmaxed among themselves. Attention has biases,
a learned sink logit a head, and alternates a sliding window of `sliding_window` tokens with
full attention (`layer_types`, HF's names); RoPE is YaRN-scaled (`yarn`). The presets match
the published config.json of gpt-oss-20b and gpt-oss-120b.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmforge.errors import ConfigError
from lmforge.models.llama.args import ModelArgs as LlamaArgs

GPT_OSS_VOCAB_SIZE = 201088
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(kw_only=True, frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (Peng et al., 2023; HF rope_type "yarn")."""

    factor: float = 32.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = False


@dataclass(kw_only=True, frozen=True)
class ModelArgs(LlamaArgs):
    """Llama's fields with gpt-oss's defaults, an explicit head_dim, and the experts'."""

    family: ClassVar[str] = "gpt_oss"
    training_fields: ClassVar[tuple[str, ...]] = ("router_aux_loss_coef",)
    # the chosen k's weights sum to one (a softmax over them), as Qwen3-MoE's with this flag
    norm_topk_prob: ClassVar[bool] = True

    head_dim: int = 64  # a field, as Qwen3's (it shadows Llama's property)
    vocab_size: int = GPT_OSS_VOCAB_SIZE
    rope_theta: float = 150000.0
    yarn: YarnScaling | None = YarnScaling()
    bos_id: int | None = 199998  # <|startoftext|>
    eos_id: int | list[int] | None = 200002  # <|return|>
    num_experts: int = 32
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()  # (): sliding then full, alternating (`attention_types`)
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.layer_types, list):  # from a config file: hashable like the rest
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.yarn, dict):
            object.__setattr__(self, "yarn", YarnScaling(**self.yarn))
        if self.layer_types and (
            len(self.layer_types) != self.num_layers
            or not set(self.layer_types) <= set(LAYER_TYPES)
        ):
            raise ConfigError(
                f"model layer_types must list {self.num_layers} of {', '.join(LAYER_TYPES)}; "
                f"got {self.layer_types!r}"
            )
        for name in ("num_experts", "num_experts_per_tok", "sliding_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {name}={value!r} must be an integer > 0")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"model num_experts_per_tok={self.num_experts_per_tok} must be <= "
                f"num_experts={self.num_experts}"
            )
        for name in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"model {name}={getattr(self, name)!r} must be > 0")
        if not self.router_aux_loss_coef >= 0:
            raise ConfigError(
                f"model router_aux_loss_coef={self.router_aux_loss_coef!r} must be a number >= 0"
            )

    def _check_head_dim(self) -> None:
        self._check_head_dim_field(
            scaling="gpt-oss takes YaRN scaling (yarn), not Llama 3's rope_scaling"
        )

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Each block's attention: `layer_types`, or by default sliding then full, alternating
        (so that a preset cut to fewer layers keeps the pattern)."""
        return self.layer_types or tuple(LAYER_TYPES[i % 2] for i in range(self.num_layers))

    def window(self, layer: int) -> int | None:
        """Block `layer`'s sliding window in tokens, None for full attention."""
        sliding = self.attention_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def is_moe_layer(self, layer: int) -> bool:
        return True  # every block is sparse

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.num_layers))

    @property
    def moe_ffn_dim(self) -> int:
        """An expert's width (Qwen3-MoE's name, which the planner reads): `ffn_dim`."""
        return self.ffn_dim

    def layer_norm_params(self) -> int:
        """The per-block vectors: two norms, the four projections' biases, a sink a head."""
        return 2 * self.dim + self.q_dim + 2 * self.kv_dim + self.dim + self.num_heads

    def mlp_params(self, layer: int, *, active: bool = False) -> int:
        """The router [E, dim] and its bias, and the experts with their biases (the chosen k
        when `active`)."""
        experts = self.num_experts_per_tok if active else self.num_experts
        per_expert = 3 * self.dim * self.ffn_dim + 2 * self.ffn_dim + self.dim
        return self.num_experts * (self.dim + 1) + experts * per_expert


PRESETS: dict[str, ModelArgs] = {
    "gpt-oss-20b": ModelArgs(
        dim=2880, num_layers=24, num_heads=64, num_kv_heads=8, ffn_dim=2880, num_experts=32
    ),
    "gpt-oss-120b": ModelArgs(
        dim=2880, num_layers=36, num_heads=64, num_kv_heads=8, ffn_dim=2880, num_experts=128
    ),
}
