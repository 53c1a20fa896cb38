"""The block products of a preset at 1-64 rows: bf16 (cuBLAS, or the GEMV at one row) against
int8 and int4 in the engine's layout (`lmforge.generate.kernels`: the GEMV at one row,
`quantized_gemm` at 2-128), each timed alone with CUDA events (median of --repeats), and the
bandwidth each reaches (weight bytes / time), each product replayed in a CUDA graph. Fills docs/benchmarks.md's "Quantized" product
table (`bash benchmarks/device_calls.sh quantized-serve` runs it first).

    python3 benchmarks/quantized_gemm.py --preset llama3.2-1b --rows 1 8 32 64
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from lmforge.generate.kernels import QuantizedLinear, gemv
from lmforge.generate.kernels.quantized_gemm import quantized_gemm
from lmforge.models import get_preset


def timed(fn, repeats: int, launches: int = 20) -> float:
    """Median milliseconds of one `fn()` on the GPU: `launches` of it recorded in a CUDA graph
    (as the engine runs them: no host time between kernels), the graph replayed `repeats`
    times. Timed eagerly, each launch measured the host's ~50 us of dispatch instead (a first
    run, 2026-12-04: every product 0.05-0.27 ms)."""
    for _ in range(3):  # autotuning and compilation happen here, outside the graph
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def quantized(weight: torch.Tensor, bits: int, group: int) -> QuantizedLinear:
    """Random values in the engine's layout for a weight [N, K] (the time does not depend on
    them)."""
    n, k = weight.shape
    if bits == 8:
        q = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=weight.device)
        return QuantizedLinear(q, torch.rand(n, 1, device=weight.device).bfloat16(),
                               torch.empty(n, 0, device=weight.device), 8)  # fmt: skip
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=weight.device)
    scale = torch.rand(n, k // group, device=weight.device).bfloat16()
    return QuantizedLinear(q, scale, torch.zeros_like(scale), 4)


def product(x, weight, layer, bits: int) -> torch.Tensor:
    """x @ w.T as the engine runs it: one row in the GEMV, more in cuBLAS (bf16) or
    `quantized_gemm`."""
    if bits == 16:
        return gemv(x, weight) if x.shape[0] == 1 else x @ weight.t()
    if x.shape[0] == 1:
        return layer(x)
    return quantized_gemm(x, layer.q, layer.scale, layer.zero, bits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--group", type=int, default=256, help="int4 group size (256)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    model = get_preset(args.preset)
    shapes = {  # the fused products of a block: (N, K)
        "wqkv": ((model.num_heads + 2 * model.num_kv_heads) * model.head_dim, model.dim),
        "wo": (model.dim, model.num_heads * model.head_dim),
        "w13": (2 * model.ffn_dim, model.dim),
        "w2": (model.dim, model.ffn_dim),
    }
    print(f"{args.preset}: ms a product (GB/s of its weight bytes); int4 group {args.group}")
    print(f"{'product':>8} {'rows':>5} {'bf16':>16} {'int8':>16} {'int4':>16}")
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        layers = {8: quantized(weight, 8, args.group), 4: quantized(weight, 4, args.group)}
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cells = []
            for bits in (16, 8, 4):
                layer = layers.get(bits)
                fn = partial(product, x, weight, layer, bits)
                if bits == 16:
                    size = weight.numel() * 2
                else:
                    size = layer.q.numel() + layer.scale.numel() * 2 * (2 if bits == 4 else 1)
                ms = timed(fn, args.repeats)
                cells.append(f"{ms:.4f} ({size / ms / 1e6:,.0f})")
            print(f"{name:>8} {rows:>5} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
