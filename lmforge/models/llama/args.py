"""Llama 3 model hyperparameters and the named presets.

The presets match the published shapes of Llama 3.1 / 3.2 (dim, layers, heads, KV heads, FFN
size, vocab 128256, RoPE theta 500000 with the Llama 3.1 frequency scaling; 3.2 ties the input
embedding to the output projection). `tiny` is a few-million-parameter model for CPU work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from lmforge.errors import ConfigError

LLAMA3_VOCAB_SIZE = 128256


@dataclass(kw_only=True, frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling ("llama3" rope_type in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(kw_only=True, frozen=True)
class ModelArgs:
    """A Llama model's shape. Other families subclass it (see lmforge/models/qwen3/args.py)."""

    family: ClassVar[str] = "llama"  # the registry's name for the family (lmforge.models)
    # fields `model.overrides` may change on a loaded model (how it trains, not its shapes)
    training_fields: ClassVar[tuple[str, ...]] = ()

    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    vocab_size: int = LLAMA3_VOCAB_SIZE
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 131072
    tie_embeddings: bool = False
    bos_id: int | None = 128000
    eos_id: int | list[int] | None = 128001

    def __post_init__(self) -> None:
        for name in ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"model {name}={value!r} must be an integer")
            if value <= 0:
                raise ConfigError(f"model {name}={getattr(self, name)} must be > 0")
        self._check_head_dim()
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("norm_eps", "rope_theta", "max_seq_len"):
            if not getattr(self, name) > 0:  # 0 or less: NaN at the first step
                raise ConfigError(f"model {name}={getattr(self, name)} must be > 0")

    def _check_head_dim_field(self, *, scaling: str) -> None:
        """For a family whose head_dim is a field (Qwen3, gpt-oss): an integer > 0, and no
        Llama 3 rope_scaling (`scaling`: what the family takes instead, for the message)."""
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool):
            raise ConfigError(f"model head_dim={self.head_dim!r} must be an integer")
        if self.head_dim <= 0:
            raise ConfigError(f"model head_dim={self.head_dim} must be > 0")
        if self.rope_scaling is not None:
            raise ConfigError(scaling)

    def _check_head_dim(self) -> None:
        if self.dim % self.num_heads:
            raise ConfigError(
                f"model dim={self.dim} must be divisible by num_heads={self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Llama derives it: dim / num_heads (a family with its own head_dim makes it a field)."""
        return self.dim // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (all heads)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection's output (all kv heads)."""
        return self.num_kv_heads * self.head_dim

    def layer_norm_params(self) -> int:
        """Norm weights of one block: the attention and MLP norms."""
        return 2 * self.dim

    def replace(self, **changes) -> ModelArgs:
        """A copy with some fields changed; unknown names are a ConfigError."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(
                f"unknown model field(s) {unknown}; allowed: {', '.join(sorted(known))}"
            )
        return dataclasses.replace(self, **changes)

    # ---- parameter and FLOP counts -------------------------------------------------------
    def mlp_params(self, layer: int, *, active: bool = False) -> int:
        """Parameters of block `layer`'s MLP; `active`: those one token runs through (all of
        them here; a Mixture-of-Experts family counts its chosen experts)."""
        return 3 * self.dim * self.ffn_dim

    def num_params(self, *, include_embedding: bool = True, active: bool = False) -> int:
        """Parameters; with include_embedding=False the input lookup table is left out
        (a tied table is still counted once, as the output projection). `active`: only those
        one token runs through (`mlp_params`); a dense model's are all of them."""
        attention = 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim
        per_layer = attention + self.layer_norm_params()
        mlp = sum(self.mlp_params(layer, active=active) for layer in range(self.num_layers))
        table = self.vocab_size * self.dim
        total = self.num_layers * per_layer + mlp + self.dim  # + final norm
        if self.tie_embeddings:
            return total + table
        return total + table + (table if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6·N (N = active matmul parameters: all but the input
        lookup, and a MoE's unchosen experts) plus 12·layers·q_dim·seq_len for attention scores
        and values (PaLM appendix B; q_dim = heads·head_dim, which is dim for Llama)."""
        return 6 * self.num_params(include_embedding=False, active=True) + 12 * (
            self.num_layers * self.q_dim * seq_len
        )


_LLAMA31_SCALING = RopeScaling(factor=8.0)
_LLAMA32_SCALING = RopeScaling(factor=32.0)

PRESETS: dict[str, ModelArgs] = {
    # ~5M parameters: the embedded demo and the tests. Vocab matches the demo tokenizer.
    "tiny": ModelArgs(
        dim=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        ffn_dim=768,
        vocab_size=4096,
        rope_theta=10000.0,
        max_seq_len=2048,
        bos_id=None,
        eos_id=None,
    ),
    "llama3.2-1b": ModelArgs(
        dim=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        ffn_dim=8192,
        rope_scaling=_LLAMA32_SCALING,
        tie_embeddings=True,
    ),
    "llama3.2-3b": ModelArgs(
        dim=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        ffn_dim=8192,
        rope_scaling=_LLAMA32_SCALING,
        tie_embeddings=True,
    ),
    "llama3.1-8b": ModelArgs(
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        ffn_dim=14336,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "llama3.1-70b": ModelArgs(
        dim=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        ffn_dim=28672,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "llama3.1-405b": ModelArgs(
        dim=16384,
        num_layers=126,
        num_heads=128,
        num_kv_heads=8,
        ffn_dim=53248,
        rope_scaling=_LLAMA31_SCALING,
    ),
}


def get_preset(name: str) -> ModelArgs:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)}") from None
