"""Text generation: a static KV cache, prefill then compiled token-by-token decode, sampling,
stop conditions, streaming, and a speed report (generate.py, sampling.py)."""

from lmforge.generate.generate import (
    GenerationOutput,
    GenerationResult,
    GenerationStats,
    GenerationStream,
    Generator,
    TokenEvent,
    weight_bytes,
)
from lmforge.generate.sampling import Sampler, SamplingParams

__all__ = [
    "GenerationOutput",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "Generator",
    "Sampler",
    "SamplingParams",
    "TokenEvent",
    "weight_bytes",
]
