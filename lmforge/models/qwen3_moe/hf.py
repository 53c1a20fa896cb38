"""Key map and config translation between our Qwen3-MoE and Hugging Face's `Qwen3MoeForCausalLM`.

Names are Qwen3's, plus a sparse block's router (`mlp.gate.weight`) and experts. The hub's files
hold one tensor per expert and projection (`mlp.experts.E.{gate,up,down}_proj.weight`);
transformers 5 holds them stacked in memory (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]), which is our layout: `stack_experts` turns the hub's keys
into the stacked ones before the key map (files with either layout load), `split_experts` the
stacked ones back into the hub's on save (what transformers 4 and 5 and vLLM read).

A model trained with DeepSeek-V3's selection bias (`router_bias_update` > 0) saves it as
`mlp.gate.e_score_correction_bias` and its rate in config.json: lmforge routes with it on
load; transformers' and vLLM's Qwen3-MoE have no such field and drop the tensor.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

import torch

from lmforge.errors import ModelFormatError
from lmforge.models.llama import hf as llama_hf
from lmforge.models.qwen3 import hf as qwen3_hf
from lmforge.models.qwen3_moe.args import ModelArgs

KEY_MAP = llama_hf.KeyMap(
    [
        *qwen3_hf.KEY_MAP.pairs,
        ("model.layers.{i}.mlp.gate.weight", "layers.{i}.feed_forward.router.weight"),
        ("model.layers.{i}.mlp.experts.gate_up_proj", "layers.{i}.feed_forward.experts.w13"),
        ("model.layers.{i}.mlp.experts.down_proj", "layers.{i}.feed_forward.experts.w2"),
        # a quantized artifact's experts as the engine keeps them (lmforge.quantize.stored)
        (
            "model.layers.{i}.mlp.experts.gate_up_proj_scale",
            "layers.{i}.feed_forward.experts.w13_scale",
        ),
        (
            "model.layers.{i}.mlp.experts.down_proj_scale",
            "layers.{i}.feed_forward.experts.w2_scale",
        ),
        # DeepSeek-V3's name for the selection bias (`router_bias_update`; not Qwen3-MoE's)
        (
            "model.layers.{i}.mlp.gate.e_score_correction_bias",
            "layers.{i}.feed_forward.expert_bias",
        ),
    ]
)
hf_to_ours = KEY_MAP.hf_to_ours
ours_to_hf = KEY_MAP.ours_to_hf

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"
)
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def stack_experts(
    hf_state: dict[str, torch.Tensor], path: Path, keep_quantized: bool = False
) -> dict[str, torch.Tensor]:
    """The hub's per-expert tensors of each layer stacked into transformers 5's two (gate rows
    then up rows in gate_up_proj); other tensors pass through. Missing experts are an error."""
    per_layer: dict[int, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
    out = {}
    for name, tensor in hf_state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        layer, expert, projection = int(match[1]), int(match[2]), match[3]
        per_layer[layer][expert, projection] = tensor
    for layer, tensors in sorted(per_layer.items()):
        num_experts = 1 + max(expert for expert, _ in tensors)
        wanted = {(e, p) for e in range(num_experts) for p in ("gate", "up", "down")}
        missing = sorted(wanted - set(tensors))
        if missing:
            expert, projection = missing[0]
            raise ModelFormatError(
                f"{path}: model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight "
                f"is missing ({len(missing)} expert tensors of layer {layer} are)"
            )
        prefix = f"model.layers.{layer}.mlp.experts"
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[e, "gate"], tensors[e, "up"]]) for e in range(num_experts)]
        )  # [E, 2I, H]
        out[f"{prefix}.down_proj"] = torch.stack(
            [tensors[e, "down"] for e in range(num_experts)]
        )  # [E, H, I]
    return out


def split_experts(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked experts back into the hub's per-expert tensors (copies: files refuse shared
    storage); other tensors pass through, in order."""
    out = {}
    for name, tensor in hf_state.items():
        match = _STACKED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix = f"model.layers.{match[1]}.mlp.experts"
        for expert, weight in enumerate(tensor.unbind(0)):
            if match[2] == "down_proj":
                out[f"{prefix}.{expert}.down_proj.weight"] = weight.clone()
            else:
                gate, up = weight.chunk(2)  # [I, H] each
                out[f"{prefix}.{expert}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{expert}.up_proj.weight"] = up.clone()
    return out


def args_from_hf_config(cfg: dict, path: Path) -> ModelArgs:
    """ModelArgs from a HF Qwen3-MoE config.json dict; `path` is named in errors."""
    if cfg.get("model_type") != "qwen3_moe":
        raise ModelFormatError(
            f"{path}: model type {cfg.get('model_type')!r} is not a Qwen3-MoE model; lmforge "
            "reads model_type 'qwen3_moe' (Qwen3MoeForCausalLM)"
        )
    dense = qwen3_hf.args_from_hf_config(cfg | {"model_type": "qwen3"}, path)
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}
    with llama_hf.config_errors(path):
        num_experts = cfg.get(
            "num_experts", cfg.get("num_local_experts")
        )  # transformers 5 saves the latter
        return ModelArgs(
            **fields,
            num_experts=int(num_experts if num_experts is not None else 128),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
            moe_ffn_dim=int(cfg.get("moe_intermediate_size", 768)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            router_bias_update=float(cfg.get("router_bias_update", 0.0)),
        )


def args_to_hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A config.json dict that transformers and vLLM load as Qwen3MoeForCausalLM."""
    return (
        qwen3_hf.args_to_hf_config(args, dtype)
        | {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": args.num_experts,
            "num_experts_per_tok": args.num_experts_per_tok,
            "moe_intermediate_size": args.moe_ffn_dim,
            "norm_topk_prob": args.norm_topk_prob,
            "decoder_sparse_step": args.decoder_sparse_step,
            "mlp_only_layers": list(args.mlp_only_layers),
            "router_aux_loss_coef": args.router_aux_loss_coef,
            "output_router_logits": False,
        }
        | ({"router_bias_update": args.router_bias_update} if args.router_bias_update else {})
    )
