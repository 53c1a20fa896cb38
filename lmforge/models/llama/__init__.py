"""The Llama 3 family: presets (args.py), the model (model.py), Hugging Face and Meta key maps
(hf.py), torchtitan checkpoints (torchtitan.py), TP plan and planner shapes (plan.py)."""

from lmforge.models.family import Family
from lmforge.models.llama import hf, plan
from lmforge.models.llama.args import PRESETS, ModelArgs, RopeScaling, get_preset
from lmforge.models.llama.model import Transformer

FAMILY = Family(
    name="llama",
    title="Llama",
    model_type="llama",
    architecture="LlamaForCausalLM",
    args_class=ModelArgs,
    model_class=Transformer,
    presets=PRESETS,
    args_from_hf_config=hf.args_from_hf_config,
    args_to_hf_config=hf.args_to_hf_config,
    hf_to_ours=hf.hf_to_ours,
    ours_to_hf=hf.ours_to_hf,
    block_params=plan.block_params,
    tp_plan=plan.tp_plan,
)

__all__ = ["FAMILY", "PRESETS", "ModelArgs", "RopeScaling", "Transformer", "get_preset"]
