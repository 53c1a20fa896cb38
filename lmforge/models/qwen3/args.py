"""Qwen3 dense model hyperparameters and the named presets.

The presets match the published config.json files of Qwen3-0.6B … Qwen3-32B (hidden size,
layers, heads, KV heads, FFN size; head_dim 128 for all, so the query projection is wider than
the residual stream on the small ones; vocab 151936; RoPE theta 1e6 without scaling; RMSNorm
eps 1e-6; 40960 positions; the input embedding tied to the output projection up to 4B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmforge.models.llama.args import ModelArgs as LlamaArgs

QWEN3_VOCAB_SIZE = 151936


@dataclass(kw_only=True, frozen=True)
class ModelArgs(LlamaArgs):
    """Llama's fields with Qwen3's defaults, plus an explicit head_dim."""

    family: ClassVar[str] = "qwen3"

    # A field here, where Llama derives it (dim / num_heads) with a property: the class
    # attribute this default leaves behind shadows that property.
    head_dim: int = 128
    vocab_size: int = QWEN3_VOCAB_SIZE
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    bos_id: int | None = 151643  # <|endoftext|>
    eos_id: int | list[int] | None = 151645  # <|im_end|>

    def _check_head_dim(self) -> None:
        self._check_head_dim_field(scaling="Qwen3 takes no rope_scaling (only the default RoPE)")

    def layer_norm_params(self) -> int:
        """The attention and MLP norms plus the query and key head norms."""
        return 2 * self.dim + 2 * self.head_dim


PRESETS: dict[str, ModelArgs] = {
    "qwen3-0.6b": ModelArgs(
        dim=1024, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=3072, tie_embeddings=True
    ),
    "qwen3-1.7b": ModelArgs(
        dim=2048, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=6144, tie_embeddings=True
    ),
    "qwen3-4b": ModelArgs(
        dim=2560, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=9728, tie_embeddings=True
    ),
    "qwen3-8b": ModelArgs(dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=12288),
    "qwen3-14b": ModelArgs(dim=5120, num_layers=40, num_heads=40, num_kv_heads=8, ffn_dim=17408),
    "qwen3-32b": ModelArgs(dim=5120, num_layers=64, num_heads=64, num_kv_heads=8, ffn_dim=25600),
}
