"""The Qwen3 dense family: presets (args.py), the model (model.py: Llama's blocks with q/k head
norms), the Hugging Face key map (hf.py), TP plan and planner shapes (plan.py)."""

from lmforge.models.family import Family
from lmforge.models.qwen3 import hf, plan
from lmforge.models.qwen3.args import PRESETS, ModelArgs
from lmforge.models.qwen3.model import Transformer

FAMILY = Family(
    name="qwen3",
    title="Qwen3",
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
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

__all__ = ["FAMILY", "PRESETS", "ModelArgs", "Transformer"]
