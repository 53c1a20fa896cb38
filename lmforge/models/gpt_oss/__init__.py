"""The gpt-oss family: presets (args.py), the model (model.py: Llama's blocks with biased,
sink-carrying, alternately windowed attention and a sparse MLP of biased experts), the Hugging
Face key map with the experts' layout and MXFP4 dequantization (hf.py), planner shapes
(plan.py)."""

from lmforge.models.family import Family
from lmforge.models.gpt_oss import hf, plan
from lmforge.models.gpt_oss.args import PRESETS, ModelArgs
from lmforge.models.gpt_oss.model import Transformer

FAMILY = Family(
    name="gpt_oss",
    title="gpt-oss",
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    args_class=ModelArgs,
    model_class=Transformer,
    presets=PRESETS,
    args_from_hf_config=hf.args_from_hf_config,
    args_to_hf_config=hf.args_to_hf_config,
    hf_to_ours=hf.hf_to_ours,
    ours_to_hf=hf.ours_to_hf,
    block_params=plan.block_params,
    tp_plan=plan.tp_plan,
    hf_merge=hf.to_our_layout,
    hf_split=hf.to_hf_layout,
    hf_output_rows=hf.output_rows,
)

__all__ = ["FAMILY", "PRESETS", "ModelArgs", "Transformer"]
