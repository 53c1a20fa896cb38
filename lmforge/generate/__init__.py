"""Text generation: the inference engine (engine.py: a slot KV cache, continuous batching,
chunked prefill, decode steps compiled per batch bucket), sequences and their stops
(sequence.py), sampling (sampling.py), `Generator` for prompts in and texts out (generate.py),
and log-probabilities of given continuations (logprobs.py)."""

from lmforge.generate.engine import Engine
from lmforge.generate.generate import (
    GenerationOutput,
    GenerationStats,
    GenerationStream,
    Generator,
    weight_bytes,
)
from lmforge.generate.sampling import Sampler, SamplingParams
from lmforge.generate.sequence import GenerationResult, Sequence, TokenEvent

__all__ = [
    "Engine",
    "GenerationOutput",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "Generator",
    "Sampler",
    "SamplingParams",
    "Sequence",
    "TokenEvent",
    "weight_bytes",
]
