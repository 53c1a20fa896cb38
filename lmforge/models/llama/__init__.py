"""The Llama 3 family: presets (args.py), the model (model.py), Hugging Face and Meta key maps (hf.py)."""

from lmforge.models.llama.args import PRESETS, ModelArgs, RopeScaling, get_preset
from lmforge.models.llama.model import Transformer

__all__ = ["PRESETS", "ModelArgs", "RopeScaling", "Transformer", "get_preset"]
