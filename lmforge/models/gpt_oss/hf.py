"""Key map and config translation between our gpt-oss and Hugging Face's `GptOssForCausalLM`.

transformers keeps the experts stacked, transposed and interleaved: `mlp.experts.gate_up_proj`
[E, dim, 2I] whose columns alternate gate and up (and `gate_up_proj_bias` [E, 2I] likewise),
`mlp.experts.down_proj` [E, I, dim]. Ours are [E, 2I, dim] gate rows then up rows and [E, dim,
I]: `to_our_layout` converts on load (the key map then renames), `to_hf_layout` back on save.
The hub's own files (openai/gpt-oss-*) hold the experts in MXFP4 (`..._blocks`: two e2m1
values a byte in blocks of 32 along the input, `..._scales`: a power-of-two exponent a block,
[E, out, in] like ours), dequantized at load (`dequantize_mxfp4`) into the other tensors'
dtype, or kept for the inference engine (`keep_quantized`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from lmforge.errors import ModelFormatError
from lmforge.models import moe
from lmforge.models.gpt_oss.args import ModelArgs, YarnScaling
from lmforge.models.llama import hf as llama_hf

_ATTENTION = [
    (f"model.layers.{{i}}.self_attn.{hf}_proj.bias", f"layers.{{i}}.attention.{ours}.bias")
    for hf, ours in (("q", "wq"), ("k", "wk"), ("v", "wv"), ("o", "wo"))
]
KEY_MAP = llama_hf.KeyMap(
    [
        *[pair for pair in llama_hf.KEY_MAP.pairs if ".mlp." not in pair[0]],
        *_ATTENTION,
        ("model.layers.{i}.self_attn.sinks", "layers.{i}.attention.sinks"),
        ("model.layers.{i}.mlp.router.weight", "layers.{i}.feed_forward.router.weight"),
        ("model.layers.{i}.mlp.router.bias", "layers.{i}.feed_forward.router.bias"),
        ("model.layers.{i}.mlp.experts.gate_up_proj", "layers.{i}.feed_forward.experts.w13"),
        ("model.layers.{i}.mlp.experts.gate_up_proj_bias", "layers.{i}.feed_forward.experts.b13"),
        ("model.layers.{i}.mlp.experts.down_proj", "layers.{i}.feed_forward.experts.w2"),
        ("model.layers.{i}.mlp.experts.down_proj_bias", "layers.{i}.feed_forward.experts.b2"),
        # MXFP4 experts kept (`to_our_layout(keep_quantized=True)`): in memory only
        (
            "model.layers.{i}.mlp.experts.gate_up_proj_scale",
            "layers.{i}.feed_forward.experts.w13_scale",
        ),
        (
            "model.layers.{i}.mlp.experts.down_proj_scale",
            "layers.{i}.feed_forward.experts.w2_scale",
        ),
    ]
)
hf_to_ours = KEY_MAP.hf_to_ours
ours_to_hf = KEY_MAP.ours_to_hf


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """MXFP4 (OCP microscaling): blocks [..., groups, 16] uint8 (the low nibble the even
    element), scales [..., groups] uint8 (a biased power-of-two exponent, 127 = 1) -> [...,
    groups · 32] in `dtype`."""
    return moe.dequantize(blocks.flatten(-2), scales, dtype)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Alternating gate, up along `dim` -> every gate, then every up."""
    index = [slice(None)] * t.dim()
    parts = []
    for start in (0, 1):
        index[dim] = slice(start, None, 2)
        parts.append(t[tuple(index)])
    return torch.cat(parts, dim=dim)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Every gate, then every up along `dim` -> alternating (`_deinterleave`'s inverse)."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def output_rows(name: str, rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`rows` [out, ...] of our weight `name` in transformers' order (`Family.hf_output_rows`):
    the experts' w13 rows (gate then up) alternate there; every other weight's are ours."""
    if not name.endswith("experts.w13"):
        return rows
    return _deinterleave(rows, 0) if inverse else _interleave(rows, 0)


def to_our_layout(
    hf_state: dict[str, torch.Tensor], path: Path, keep_quantized: bool = False
) -> dict[str, torch.Tensor]:
    """The experts of a transformers or hub state dict in our layout, under transformers'
    names; other tensors pass through. MXFP4 experts are dequantized, or with `keep_quantized`
    kept as they are (`moe.QuantizedExperts`' MXFP4: the blocks' bytes [E, out, in / 2], the
    scale bytes [E, out, in / 32] under `..._proj_scale`), gate and up rows apart either way."""
    dtype = next((t.dtype for t in hf_state.values() if t.is_floating_point()), torch.bfloat16)
    out = {}
    for name, tensor in hf_state.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):  # MXFP4, [E, out, in] already
            prefix = name.removesuffix("_blocks")
            scales = hf_state.get(f"{prefix}_scales")
            if scales is None:
                raise ModelFormatError(f"{path}: {name} has no {prefix}_scales beside it")
            if keep_quantized:
                kept = {prefix: tensor.flatten(-2), f"{prefix}_scale": scales}
            else:
                kept = {prefix: dequantize_mxfp4(tensor, scales, dtype)}
            if prefix.endswith("gate_up_proj"):
                kept = {key: _deinterleave(t, 1) for key, t in kept.items()}
            out |= {key: t.contiguous() for key, t in kept.items()}
        elif name.endswith("experts.gate_up_proj"):
            out[name] = _deinterleave(tensor.transpose(1, 2), 1)
        elif name.endswith("experts.gate_up_proj_bias"):
            out[name] = _deinterleave(tensor, 1)
        elif name.endswith("experts.down_proj"):
            # contiguous: a transposed view broadcast from rank 0 (set_model_state_dict)
            # arrived elsewhere in its storage's order
            out[name] = tensor.transpose(1, 2).contiguous()
        else:
            out[name] = tensor
    return out


def to_hf_layout(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`to_our_layout`'s inverse for saving: transformers' stacked, transposed, interleaved
    experts (copies: files refuse shared storage)."""
    out = {}
    for name, tensor in hf_state.items():
        if name.endswith("experts.gate_up_proj"):
            tensor = _interleave(tensor, 1).transpose(1, 2)
        elif name.endswith("experts.gate_up_proj_bias"):
            tensor = _interleave(tensor, 1)
        elif name.endswith("experts.down_proj"):
            tensor = tensor.transpose(1, 2)
        out[name] = tensor.contiguous()
    return out


def _yarn(cfg: dict, path: Path) -> tuple[float, YarnScaling | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 150000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ModelFormatError(
            f"{path}: rope_type {rope_type!r} is not supported for gpt-oss; allowed: yarn, default"
        )
    defaults = YarnScaling()
    return theta, YarnScaling(
        factor=float(params.get("factor", defaults.factor)),
        original_max_seq_len=int(params.get("original_max_position_embeddings", 4096)),
        beta_fast=float(params.get("beta_fast", defaults.beta_fast)),
        beta_slow=float(params.get("beta_slow", defaults.beta_slow)),
        truncate=bool(params.get("truncate", defaults.truncate)),
    )


def args_from_hf_config(cfg: dict, path: Path) -> ModelArgs:
    """ModelArgs from a HF gpt-oss config.json dict; `path` is named in errors."""
    if cfg.get("model_type") != "gpt_oss":
        raise ModelFormatError(
            f"{path}: model type {cfg.get('model_type')!r} is not a gpt-oss model; lmforge reads "
            "model_type 'gpt_oss' (GptOssForCausalLM)"
        )
    if cfg.get("attention_bias") is False:
        raise ModelFormatError(
            f"{path}: attention_bias=false is not supported (gpt-oss has biases)"
        )
    with llama_hf.config_errors(path):
        theta, yarn = _yarn(cfg, path)
        return ModelArgs(
            **llama_hf.common_fields(cfg | {"rms_norm_eps": cfg.get("rms_norm_eps", 1e-5)}),
            head_dim=int(cfg.get("head_dim") or 64),
            rope_theta=theta,
            yarn=yarn,
            num_experts=int(cfg.get("num_local_experts", 32)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 4)),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            sliding_window=int(cfg.get("sliding_window") or 128),
            layer_types=tuple(cfg.get("layer_types") or ()),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
        )


def args_to_hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A config.json dict that transformers and vLLM load as GptOssForCausalLM."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:
        yarn = dataclasses.asdict(args.yarn)
        rope = {
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": yarn["factor"],
            "original_max_position_embeddings": yarn["original_max_seq_len"],
            "beta_fast": yarn["beta_fast"],
            "beta_slow": yarn["beta_slow"],
            "truncate": yarn["truncate"],
        }
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **llama_hf.common_hf_config(args, dtype),
        "attention_bias": True,
        "rope_scaling": rope,
        "layer_types": list(args.attention_types),
        "sliding_window": args.sliding_window,
        "num_local_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "output_router_logits": False,
    }
