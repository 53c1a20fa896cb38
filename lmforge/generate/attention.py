"""The attention kernels of inference's eager forwards (prefill, scoring) on a GPU.

Their shapes change with nearly every batch: prompt widths, cache lengths, batch sizes. PyTorch
prefers cuDNN's attention on Hopper GPUs, and cuDNN builds an execution plan for every new shape
on the host: on an H200 the server spent 67% of its engine thread there at one stream (first
tokens up to 0.8 s late). FlashAttention and the memory-efficient kernel need no such set-up; the
compiled decode steps (fixed shapes, CUDA graphs) keep PyTorch's choice.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# In PyTorch's order of preference once cuDNN is out: flash takes causal attention (grouped
# heads included), the others an explicit mask (a prompt's later chunks).
SHAPE_FREE_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def shape_free_attention(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A context in which attention on `device` uses kernels without per-shape set-up (CUDA
    only; elsewhere nothing changes)."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(SHAPE_FREE_BACKENDS)
