"""Model families and the one registry that maps a config to its family.

One family = one folder (`args.py` presets, `model.py`, `hf.py` key map and config.json
translation, `plan.py` tensor-parallel plan and the planner's parameter shapes) whose package
exports `FAMILY` (lmforge.models.family.Family). Code outside models/ never imports a family by
name: it asks this module for the family of a config.json (`model_type`), a preset name or a
`ModelArgs`, and uses the family-independent helpers below.

`ModelArgs` and `Transformer` are the base classes every family's args and model derive from
(Llama's, the first family): annotations outside models/ use them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.errors import ConfigError, ModelFormatError
from lmforge.models import gpt_oss, llama, qwen3, qwen3_moe
from lmforge.models.family import Family, ParamShape
from lmforge.models.llama import torchtitan
from lmforge.models.llama.args import ModelArgs
from lmforge.models.llama.hf import args_from_meta_params, merge_meta_shards
from lmforge.models.llama.model import Transformer

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, gpt_oss.FAMILY)

PRESETS: dict[str, ModelArgs] = {
    name: args for family in FAMILIES for name, args in family.presets.items()
}
assert len(PRESETS) == sum(len(f.presets) for f in FAMILIES), "preset names must be unique"

# Re-exported for lmforge.api: the checkpoint formats only Llama is published in, Meta's
# original download (`args_from_meta_params`, `merge_meta_shards`) and torchtitan's DCP
# checkpoints (`torchtitan`).
__all__ = [
    "FAMILIES",
    "PRESETS",
    "Family",
    "ModelArgs",
    "ParamShape",
    "Transformer",
    "args_from_hf_config",
    "args_from_meta_params",
    "args_to_hf_config",
    "family_of",
    "get_preset",
    "hf_state_dict_to_ours",
    "hf_to_ours",
    "merge_meta_shards",
    "new_model",
    "ours_state_dict_to_hf",
    "ours_to_hf",
    "torchtitan",
]


def get_preset(name: str) -> ModelArgs:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; allowed: {', '.join(PRESETS)}") from None


def family_of(args: ModelArgs) -> Family:
    """The family a `ModelArgs` (or a model, through its `.args`) belongs to."""
    args = getattr(args, "args", args)
    for family in FAMILIES:
        if family.name == args.family:
            return family
    raise AssertionError(f"no registered family {args.family!r}")


def _family_of_config(cfg: dict, path: Path) -> Family:
    """By config.json's model_type, else by its architectures."""
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    for family in FAMILIES:
        if model_type == family.model_type:
            return family
    for family in FAMILIES:
        if model_type is None and family.architecture in architectures:
            return family
    found = model_type or architectures or "none"
    allowed = ", ".join(f"{f.model_type!r} ({f.architecture})" for f in FAMILIES)
    raise ModelFormatError(
        f"{path}: model type {found!r} is not supported; lmforge reads model_type {allowed}"
    )


def args_from_hf_config(cfg: dict, path: Path) -> ModelArgs:
    """The args of a HF config.json dict, by its model_type; `path` is named in errors."""
    return _family_of_config(cfg, path).args_from_hf_config(cfg, path)


def args_to_hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A config.json dict transformers and vLLM load as the family's *ForCausalLM."""
    return family_of(args).args_to_hf_config(args, dtype)


def hf_state_dict_to_ours(
    hf_state: dict[str, torch.Tensor], args: ModelArgs, path: Path, keep_quantized: bool = False
) -> dict[str, torch.Tensor]:
    return family_of(args).hf_state_dict_to_ours(hf_state, path, keep_quantized)


def ours_state_dict_to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict:
    return family_of(args).ours_state_dict_to_hf(state, args)


def hf_to_ours(name: str, args: ModelArgs) -> str | None:
    """Our parameter name of a HF key, None for one the family does not keep."""
    return family_of(args).hf_to_ours(name)


def ours_to_hf(name: str, args: ModelArgs) -> str:
    """The HF key of one of our parameter names ('layers.0.attention.wq.weight')."""
    return family_of(args).ours_to_hf(name)


def new_model(args: ModelArgs) -> Transformer:
    """The family's model for `args`, on the current default device (build it under
    `torch.device("meta")`, then `to_empty` and load or `init_weights`)."""
    return family_of(args).model_class(args)
