"""The quantization schemes `lmforge quantize` offers: the one list that the command line, the
pipeline's stage schema and the torchao code read (torch-free, so `--help` stays light), and
int4's group sizes, which the planner reads too."""

from collections.abc import Iterable

SCHEMES = ("int8-wo", "int4-wo", "fp8")
# Weight-only schemes (torchao's layouts, lmforge's kernels); fp8 is W8A8: float8 e4m3 weights
# with a scale a row and activations quantized a row at run time, written in compressed-tensors'
# FP8-dynamic format.
WEIGHT_ONLY = ("int8-wo", "int4-wo")
# int4's group sizes, largest first: those the CUDA int4 kernel (tinygemm) accepts. The first is
# the default (Llama 3.1 8B decodes 9% faster in groups of 256 than of 128: docs/benchmarks.md).
INT4_GROUP_SIZES = (256, 128, 64, 32)


def default_int4_group_size(input_sizes: Iterable[int]) -> int | None:
    """int4's group size when none is given: the largest of INT4_GROUP_SIZES that divides every
    quantized linear's input size (`input_sizes`), or None when none does."""
    sizes = set(input_sizes)
    return next((g for g in INT4_GROUP_SIZES if all(size % g == 0 for size in sizes)), None)
