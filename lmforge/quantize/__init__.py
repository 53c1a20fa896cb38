"""Weight-only int8 / int4 quantization through torchao, as an artifact-to-artifact stage.

See `lmforge.quantize.quantize` for the schemes, the on-disk format and what loads it.
"""

from lmforge.quantize.quantize import (
    SCHEMES,
    QuantizeResult,
    QuantSpec,
    SizeReport,
    check_scheme,
    is_quantized,
    quantize_artifact,
    quantize_model,
    save_quantized,
    supported_schemes,
    weight_file_bytes,
)

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
