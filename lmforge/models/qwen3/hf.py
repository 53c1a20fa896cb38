"""Key map and config translation between our Qwen3 and Hugging Face's `Qwen3ForCausalLM`.

The names are Llama's plus the two head norms; config.json carries head_dim explicitly, RoPE
theta (top level, or in `rope_parameters` since transformers 5) and no sliding window for the
dense models.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.errors import ModelFormatError
from lmforge.models.llama import hf as llama_hf
from lmforge.models.qwen3.args import ModelArgs

KEY_MAP = llama_hf.KeyMap(
    [
        *llama_hf.KEY_MAP.pairs,
        ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attention.q_norm.weight"),
        ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attention.k_norm.weight"),
    ]
)
hf_to_ours = KEY_MAP.hf_to_ours
ours_to_hf = KEY_MAP.ours_to_hf


def _rope_theta(cfg: dict, path: Path) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ModelFormatError(
            f"{path}: rope_type {rope_type!r} is not supported for Qwen3; allowed: default"
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def args_from_hf_config(cfg: dict, path: Path) -> ModelArgs:
    """ModelArgs from a HF Qwen3 config.json dict; `path` is named in errors."""
    if cfg.get("model_type") != "qwen3":
        raise ModelFormatError(
            f"{path}: model type {cfg.get('model_type')!r} is not a Qwen3 model; lmforge reads "
            "model_type 'qwen3' (Qwen3ForCausalLM)"
        )
    llama_hf.refuse_biases(cfg, path, "Qwen3")
    if cfg.get("use_sliding_window"):
        raise ModelFormatError(f"{path}: use_sliding_window=true is not supported")
    with llama_hf.config_errors(path):
        return ModelArgs(
            **llama_hf.common_fields(cfg),
            head_dim=int(cfg.get("head_dim") or 128),  # transformers' Qwen3Config default
            rope_theta=_rope_theta(cfg, path),
        )


def args_to_hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A config.json dict that transformers and vLLM load as Qwen3ForCausalLM."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **llama_hf.common_hf_config(args, dtype),
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.num_layers,
    }
