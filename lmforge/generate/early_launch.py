"""Programmatic dependent launch for the batch-1 decode step's kernels (Hopper and later).

A CUDA stream starts a kernel only when the one before it has finished, so each of the step's
~90 short kernels begins with an empty GPU: its programs are scheduled, then read their first
bytes, while nothing else runs. Launched with the programmatic-serialization attribute
(`launch_pdl`), a kernel starts once every program of the kernel before it has started, and
runs until `gdc_wait`, which returns when that kernel has finished and its writes are
visible. Before the wait a kernel may only touch what no kernel of the step writes: the GEMV
loads its first weight tiles there (`kernels.gemv_kernel.PRELOAD`). The attention kernel
reading its first block of cached keys and values there (earlier steps wrote them) gained nothing measurable on
an H200: 1B bf16 1,250.4 tok/s against 1,253.3 without, int8 1,058.5 against 1,051.1. Asking
for a program's whole weights in L2 there instead (one bulk prefetch a program) made the step
slower: 1B bf16 1,034 tok/s against 1,148 launched early without it and 1,108 not early
(docs/benchmarks.md).

Every kernel launched early waits before it reads or writes anything else, so a kernel's
completion still implies its predecessors' (the wait cannot return sooner), and a kernel
launched normally after one of these sees a stream in order. CUDA graphs record the attribute
as a programmatic edge (CUDA 12.3 and later).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

ENABLED = True  # benchmarks switch it off to measure what it gives
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter (the CPU tests)


@cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def early_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch early (`launch_pdl`, `EARLY`): sm_90 and later."""
    if not ENABLED or INTERPRETED or device.type != "cuda" or torch.version.hip:
        return False  # (ROCm's "cuda" devices have no such launch)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _hopper_or_later(index)


@triton.jit
def wait_for_previous(EARLY: tl.constexpr):
    """Wait until the kernel before has finished (its writes visible), then let the next one
    launch: every program of this kernel is running by the time the next one starts."""
    if EARLY:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
