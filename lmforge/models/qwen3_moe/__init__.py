"""The Qwen3-MoE family: presets (args.py), the model (model.py: Qwen3's blocks with a sparse MLP
from lmforge/models/moe.py), the Hugging Face key map with per-expert tensors stacked on load
and split on save (hf.py), TP plan and planner shapes (plan.py)."""

from lmforge.models.family import Family
from lmforge.models.qwen3_moe import hf, plan
from lmforge.models.qwen3_moe.args import PRESETS, ModelArgs
from lmforge.models.qwen3_moe.model import Transformer

FAMILY = Family(
    name="qwen3_moe",
    title="Qwen3-MoE",
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    args_class=ModelArgs,
    model_class=Transformer,
    presets=PRESETS,
    args_from_hf_config=hf.args_from_hf_config,
    args_to_hf_config=hf.args_to_hf_config,
    hf_to_ours=hf.hf_to_ours,
    ours_to_hf=hf.ours_to_hf,
    block_params=plan.block_params,
    tp_plan=plan.tp_plan,
    hf_merge=hf.stack_experts,
    hf_split=hf.split_experts,
)

__all__ = ["FAMILY", "PRESETS", "ModelArgs", "Transformer"]
