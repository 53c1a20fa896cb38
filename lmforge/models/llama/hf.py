"""Key maps and config translation between our Llama and the Hugging Face / Meta formats.

HF `LlamaForCausalLM` names <-> ours (Meta's names), and `config.json` <-> `ModelArgs`. Meta's
original checkpoints (`consolidated.NN.pth` + `params.json`) pair RoPE dimensions interleaved;
our model (like HF) pairs the first and second half of each head, so wq/wk are permuted once on
import. Model-parallel Meta shards are concatenated along the dimension each layer was split on.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from lmforge.errors import ConfigError, ModelFormatError
from lmforge.models.llama.args import ModelArgs, RopeScaling

# (HF name, our name); `{i}` stands for the layer index.
_KEY_MAP = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attention.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attention.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attention.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.feed_forward.w1.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.feed_forward.w2.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.feed_forward.w3.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
]


class KeyMap:
    """Parameter names both ways between HF and ours, from (HF, ours) templates where `{i}`
    stands for the layer index."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = pairs
        self._to_ours = [(self._pattern(hf), ours) for hf, ours in pairs]
        self._to_hf = [(self._pattern(ours), hf) for hf, ours in pairs]

    @staticmethod
    def _pattern(template: str) -> re.Pattern:
        return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")

    @staticmethod
    def _translate(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
        for pattern, template in table:
            match = pattern.match(name)
            if match:
                return template.format(i=match.group(1)) if match.groups() else template
        return None

    def hf_to_ours(self, name: str) -> str | None:
        """Our parameter name for a HF key; None for keys we do not keep."""
        return self._translate(name, self._to_ours)

    def ours_to_hf(self, name: str) -> str:
        hf = self._translate(name, self._to_hf)
        assert hf is not None, f"no HF name for {name}"
        return hf

    def knows_ours(self, name: str) -> bool:
        return self._translate(name, self._to_hf) is not None


KEY_MAP = KeyMap(_KEY_MAP)
hf_to_ours = KEY_MAP.hf_to_ours
ours_to_hf = KEY_MAP.ours_to_hf


# ---- config.json --------------------------------------------------------------------------


def _rope_from_hf(cfg: dict, path: Path) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 nests theta and scaling in `rope_parameters`; older files (and real
    # Llama 3.1 downloads) keep top-level `rope_theta` and `rope_scaling`.
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if "rope_type" in params else None)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ModelFormatError(
            f"{path}: rope_type {rope_type!r} is not supported; allowed: default, llama3"
        )
    return float(theta), RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_seq_len=int(scaling["original_max_position_embeddings"]),
    )


@contextmanager
def config_errors(path: Path):
    """Turn what reading a config.json's values raises into one-line ModelFormatErrors."""
    try:
        yield
    except KeyError as err:
        raise ModelFormatError(f"{path}: config.json lacks the key {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:  # "hidden_size": "big"
        raise ModelFormatError(
            f"{path}: config.json has a value of the wrong type ({err})"
        ) from None
    except ConfigError as err:  # a shape the model cannot have
        raise ModelFormatError(f"{path}: {err}") from None


def refuse_biases(cfg: dict, path: Path, title: str) -> None:
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ModelFormatError(f"{path}: {flag}=true is not supported ({title} has no biases)")


def common_fields(cfg: dict) -> dict:
    """The ModelArgs fields every Llama-like config.json spells the same way (raises KeyError,
    TypeError, ValueError: wrap in `config_errors`)."""
    num_heads = int(cfg["num_attention_heads"])
    return dict(
        dim=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        ffn_dim=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_id=cfg.get("bos_token_id"),
        eos_id=cfg.get("eos_token_id"),
    )


def common_hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """The config.json keys every Llama-like model writes the same way."""
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": args.bos_id,
        "eos_token_id": args.eos_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def args_from_hf_config(cfg: dict, path: Path) -> ModelArgs:
    """ModelArgs from a HF Llama config.json dict; `path` is named in errors."""
    architectures = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in architectures:
        found = cfg.get("model_type") or architectures or "none"
        raise ModelFormatError(
            f"{path}: model type {found!r} is not a Llama model; lmforge reads model_type "
            "'llama' (LlamaForCausalLM)"
        )
    refuse_biases(cfg, path, "Llama 3")
    with config_errors(path):
        fields = common_fields(cfg)
        head_dim = cfg.get("head_dim")
        if head_dim is not None and int(head_dim) != fields["dim"] // fields["num_heads"]:
            raise ModelFormatError(
                f"{path}: head_dim={head_dim} differs from hidden_size/num_attention_heads="
                f"{fields['dim'] // fields['num_heads']}; not supported"
            )
        theta, scaling = _rope_from_hf(cfg, path)
        return ModelArgs(**fields, rope_theta=theta, rope_scaling=scaling)


def args_to_hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A config.json dict that transformers (4.x and 5.x) and vLLM load as LlamaForCausalLM."""
    rope_scaling = None
    if args.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling.factor,
            "low_freq_factor": args.rope_scaling.low_freq_factor,
            "high_freq_factor": args.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": args.rope_scaling.original_max_seq_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **common_hf_config(args, dtype),
        "rope_scaling": rope_scaling,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


# ---- Meta's original format ---------------------------------------------------------------


def args_from_meta_params(params: dict, path: Path) -> ModelArgs:
    """ModelArgs from Meta's params.json (ffn size derived from multiple_of and multiplier)."""
    try:
        dim = int(params["dim"])
        hidden = int(2 * (4 * dim) / 3)
        if params.get("ffn_dim_multiplier") is not None:
            hidden = int(params["ffn_dim_multiplier"] * hidden)
        multiple_of = int(params.get("multiple_of", 256))
        ffn_dim = multiple_of * math.ceil(hidden / multiple_of)
        num_heads = int(params["n_heads"])
        return ModelArgs(
            dim=dim,
            num_layers=int(params["n_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(params.get("n_kv_heads") or num_heads),
            ffn_dim=ffn_dim,
            vocab_size=int(params["vocab_size"]),
            norm_eps=float(params.get("norm_eps", 1e-5)),
            rope_theta=float(params.get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling(factor=float(params.get("rope_scaling_factor", 8.0)))
            if params.get("use_scaled_rope")
            else None,
            max_seq_len=int(
                params.get("max_seq_len", 131072 if params.get("use_scaled_rope") else 8192)
            ),
            tie_embeddings=False,
        )
    except KeyError as err:
        raise ModelFormatError(f"{path}: params.json lacks the key {err.args[0]!r}") from None


# Dimension along which Meta's model-parallel shards split each weight (None: replicated).
def _meta_split_dim(name: str) -> int | None:
    if name == "tok_embeddings.weight":
        return 1  # ParallelEmbedding splits the embedding dimension
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")):
        return 0  # column parallel
    if name == "output.weight":
        return 0
    if name.endswith(("wo.weight", "w2.weight")):
        return 1  # row parallel
    return None


def interleaved_to_half(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Permute q/k projection rows from Meta's interleaved RoPE pairs to the half layout.

    weight [heads * head_dim, dim]: per head, rows (0,1),(2,3),... are pairs in Meta's layout;
    in ours row j pairs with row j + head_dim/2.
    """
    out_dim, dim = weight.shape
    head_dim = out_dim // num_heads
    # [heads, head_dim/2, 2, dim] -> [heads, 2, head_dim/2, dim]
    return weight.view(num_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(out_dim, dim)


def merge_meta_shards(
    shards: list[dict[str, torch.Tensor]], args: ModelArgs, path: Path
) -> dict[str, torch.Tensor]:
    """Concatenate model-parallel shards and permute wq/wk; returns our state dict."""
    merged = {}
    for name in shards[0]:
        if name.endswith("rope.freqs"):
            continue
        parts = [shard[name] for shard in shards]
        split_dim = _meta_split_dim(name)
        if split_dim is None or len(parts) == 1:
            tensor = parts[0]
        else:
            tensor = torch.cat(parts, dim=split_dim)
        if name.endswith("attention.wq.weight"):
            tensor = interleaved_to_half(tensor, args.num_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = interleaved_to_half(tensor, args.num_kv_heads)
        if not KEY_MAP.knows_ours(name):
            raise ModelFormatError(f"{path}: unexpected tensor {name!r} in a Meta checkpoint")
        merged[name] = tensor
    return merged
