"""Weight-only int8 / int4 quantization through torchao, as an artifact-to-artifact stage.

See `lmforge.quantize.quantize` for the schemes, the on-disk format and what loads it, and
`lmforge.quantize.stage` for the stage (streamed from safetensors, or the whole model). The names
below are imported on first use, so `lmforge.quantize.schemes` stays free of torch.
"""

from lmforge.quantize.schemes import SCHEMES

__all__ = [
    "SCHEMES",
    "QuantSpec",
    "QuantizeResult",
    "SizeReport",
    "check_scheme",
    "is_quantized",
    "quantize_artifact",
    "quantize_model",
    "save_quantized",
    "supported_schemes",
    "weight_file_bytes",
]


def __getattr__(name: str):
    if name == "quantize_artifact":
        from lmforge.quantize import stage

        return stage.quantize_artifact
    if name in __all__:
        from lmforge.quantize import quantize

        return getattr(quantize, name)
    raise AttributeError(f"module 'lmforge.quantize' has no attribute {name!r}")
