"""The block products of a preset at 1-64 rows: bf16 (cuBLAS, or the GEMV at one row) against
int8 and int4 in the engine's layout (`lmforge.generate.kernels`: the GEMV at one row,
`quantized_gemm` at 2-128), each timed alone with CUDA events (median of --repeats), and the
bandwidth each reaches (weight bytes / time), each product replayed in a CUDA graph. Fills docs/benchmarks.md's "Quantized" product
table (`bash benchmarks/device_calls.sh quantized-serve` runs it first).

    python3 benchmarks/quantized_gemm.py --preset llama3.2-1b --rows 1 8 32 64

--variants adds columns for `quantized_gemm.VARIANT`s (swap: the weight tile as the product's
left operand; fast: dequantized in bf16 arithmetic) and for GemLite (pip gemlite, its Triton
A16W8 / A16W4 kernels, the peer docs/benchmarks.md compares with).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from lmforge.generate.kernels import QuantizedLinear, gemv
from lmforge.generate.kernels import quantized_gemm as tiled
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


VARIANTS = {"plain": {"swap": False, "fast": False}, "swap": {"swap": True, "fast": False},
            "swap-fast": {"swap": True, "fast": True},
            "fast": {"swap": False, "fast": True}}  # fmt: skip


def variant_product(x, layer, bits: int, variant: dict) -> torch.Tensor:
    tiled.VARIANT.update(variant)
    try:
        return quantized_gemm(x, layer.q, layer.scale, layer.zero, bits)
    finally:
        tiled.VARIANT.update(swap=None, fast=None)


def gemlite_layer(n: int, k: int, bits: int, group: int):
    """GemLite's linear for a random [N, K] weight: int8 per row (A16W8_INT8), or int4 in
    groups with float zeros (HQQ's layout, A16W4_HQQ_INT)."""
    import gemlite.helper as helper

    if bits == 8:
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        return helper.A16W8_INT8(device="cuda", dtype=torch.bfloat16).from_linear(linear)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scale = torch.rand(n, k // group, device="cuda").bfloat16() * 1e-2
    zero = torch.full_like(scale, 8.0)
    return helper.A16W4_HQQ_INT(device="cuda", dtype=torch.bfloat16).from_weights(q, scale, zero)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--group", type=int, default=256, help="int4 group size (256)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--variants", nargs="*", default=[], choices=[*VARIANTS, "gemlite"])
    parser.add_argument("--products", nargs="*", default=["wqkv", "wo", "w13", "w2"])
    args = parser.parse_args()
    model = get_preset(args.preset)
    shapes = {  # the fused products of a block: (N, K)
        "wqkv": ((model.num_heads + 2 * model.num_kv_heads) * model.head_dim, model.dim),
        "wo": (model.dim, model.num_heads * model.head_dim),
        "w13": (2 * model.ffn_dim, model.dim),
        "w2": (model.dim, model.ffn_dim),
    }
    print(f"{args.preset}: ms a product (GB/s of its weight bytes); int4 group {args.group}")
    extra = [f"{b}-{v}" for v in args.variants for b in ("int8", "int4")]
    print(
        f"{'product':>8} {'rows':>5} "
        + " ".join(f"{c:>16}" for c in ["bf16", "int8", "int4", *extra])
    )
    for name, (n, k) in shapes.items():
        if name not in args.products:
            continue
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        layers = {8: quantized(weight, 8, args.group), 4: quantized(weight, 4, args.group)}
        peers = (
            {b: gemlite_layer(n, k, b, args.group) for b in (8, 4)}
            if "gemlite" in args.variants
            else {}
        )
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
            for variant in args.variants:
                for bits in (8, 4):
                    layer = layers[bits]
                    size = layer.q.numel() + layer.scale.numel() * 2 * (2 if bits == 4 else 1)
                    if variant == "gemlite":
                        fn = partial(peers[bits], x)
                    elif rows == 1:
                        cells.append("-")
                        continue
                    else:
                        fn = partial(variant_product, x, layer, bits, VARIANTS[variant])
                    try:
                        ms = timed(fn, args.repeats)
                        cells.append(f"{ms:.4f} ({size / ms / 1e6:,.0f})")
                    except Exception as error:  # a peer's failure is a cell, not the table's end
                        cells.append(type(error).__name__)
                        why = str(error.__cause__ or error).splitlines()[-1:]
                        print(f"{variant} int{bits} rows {rows}: {why}", flush=True)
            print(f"{name:>8} {rows:>5} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
