"""The batch-1 decode step's products, each launched a few times outside any graph, for Nsight
Compute to read their hardware counters: the 1B's (or 3B's) four block products as the fused
decode block launches them (with the norm, SiLU·up, residual adds), in bf16, int8 (one scale a
row) and int4 (groups of 128), on random weights, with the tiles pinned for this GPU.

    ncu --clock-control none --kernel-name regex:_gemv --launch-skip 4 --launch-count 12 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 benchmarks/ncu_products.py --shape 1b

Alone (without ncu) it prints each product's time in a CUDA graph, caches flushed between
launches by a 256 MB write, so the weights come from memory as in the step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import graph_us
from benchmarks.gemv import SHAPES
from lmforge.generate.kernels import gemv

FUSIONS = {"wqkv": "norm", "wo": "residual", "w13": "norm swiglu", "w2": "made residual"}


def weight_args(n: int, k: int, bits: int) -> tuple:
    """Random weight arguments of `gemv` in the kernels' layouts."""
    if bits == 16:
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, None, None, 16
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        scale = torch.rand(n, 1, device="cuda", dtype=torch.bfloat16) * 1e-3
        return q, scale, scale.new_empty(n, 0), 8
    q = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
    scale = torch.rand(n, k // 128, device="cuda", dtype=torch.bfloat16) * 1e-2
    return q, scale, torch.randn_like(scale) * 1e-3, 4


def product(name: str, n: int, k: int, bits: int):
    """A closure launching one product as the fused block does."""
    fusions = FUSIONS[name].split()
    weight = weight_args(n, k, bits)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    residual = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    kwargs = {
        "norm": norm if "norm" in fusions else None,
        "eps": 1e-5,
        "gated": "made" in fusions,
        "residual": residual if "residual" in fusions else None,
        "swiglu": "swiglu" in fusions,
    }
    return lambda: gemv(x, *weight, **kwargs)


def flushed_us(fn, flush: torch.Tensor) -> float:
    """Microseconds a launch of fn in a CUDA graph after a write of `flush` (L2 emptied of the
    weights), less the write alone."""
    write = lambda i: flush.fill_(1)  # noqa: E731
    return graph_us(lambda i: (write(i), fn()), 20) - graph_us(write, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4])
    parser.add_argument("--launches", type=int, default=6)
    parser.add_argument("--untimed", action="store_true", help="launch only (under ncu)")
    args = parser.parse_args()
    flush = torch.empty(256 * 2**20 // 4, device="cuda")
    for bits in args.bits:
        for name, n, k in SHAPES[args.shape]:
            if name not in FUSIONS:
                continue
            fn = product(name, n, k, bits)
            for _ in range(args.launches):
                fn()
            torch.cuda.synchronize()
            if args.untimed:
                continue
            size = n * k * bits // 8
            us = flushed_us(fn, flush)
            print(f"{args.shape} {name} bits {bits}: {us:.2f} us, {size / us / 1e6:.2f} TB/s")


if __name__ == "__main__":
    main()
