"""The decode engine's matrix products one at a time, on one GPU: every linear shape of the 1B
and 3B presets, for 1, 64 and 2048 rows of activations, timed inside a CUDA graph
(`triton.testing.do_bench_cudagraph`: kernel time without launch overhead), as GB/s of weight
bytes read.

Rows per shape: bf16 through cuBLAS (`F.linear`), bf16 as inductor's tuned reduction (what the
engine's batch-1 step compiled to before lmforge's GEMV), bf16 in lmforge's Triton GEMV, alone
and with what a fused decode block takes into it (the norm, SiLU·up, the residual add); int8
weight-only through torchao (compiled, coordinate descent tuning at one row) and in lmforge's
kernels; int4 (group 128) through tinygemm and in lmforge's kernels (one row: the GEMV; more:
expanded to bf16, then cuBLAS). Each lmforge output is checked against torchao's on the same
weight. The GB/s column counts weight bytes only: it means something at one row.

    python benchmarks/gemv.py                 # writes gemv.json to $OUT (or .)
    python benchmarks/gemv.py --rows 1 --shapes 1b
    python benchmarks/gemv.py --rows 1 --kernels "bf16 lmforge" int4   # only those rows
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # (name, outputs N, inputs K), fused q/k/v and gate/up as the engine runs them
    "1b": [
        ("wqkv", 3072, 2048),
        ("wo", 2048, 2048),
        ("w13", 16384, 2048),
        ("w2", 2048, 8192),
        ("output", 128256, 2048),
    ],
    "3b": [("wqkv", 5120, 3072), ("wo", 3072, 3072), ("w13", 16384, 3072), ("w2", 3072, 8192)],
}


# The work each product of a fused decode block (`FusedDecodeBlock`) takes in with it (w2's
# input is SiLU·up, made by w13: "gated" for int4's scaling; "gated+residual" makes it in w2).
FUSED = {"wqkv": "norm", "wo": "residual", "w13": "norm+swiglu", "w2": "made+residual"}


def fused_inputs(fused: str, x: torch.Tensor, weight: torch.Tensor):
    """`gemv`'s arguments for a fused product of x [1, K] and its reference output, unfused."""
    n, k = weight.shape
    if fused.startswith("norm"):
        norm = torch.rand(k, device=x.device, dtype=x.dtype) + 0.5
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        inputs = {"x": x, "weight": weight, "norm": norm, "eps": 1e-5}
        y = F.linear((normed * norm.float()).to(x.dtype), weight)
        if fused == "norm+swiglu":
            gate, up = y.chunk(2, dim=-1)
            return inputs | {"swiglu": True}, F.silu(gate) * up
        return inputs, y
    residual = torch.randn(n, device=x.device, dtype=x.dtype)
    if fused in ("residual", "made+residual"):
        inputs = {"x": x, "weight": weight, "residual": residual, "gated": fused != "residual"}
        return inputs, F.linear(x, weight) + residual
    gate_up = torch.randn(1, 2 * k, device=x.device, dtype=x.dtype)  # gated+residual
    gate, up = gate_up.chunk(2, dim=-1)
    inputs = {"x": gate_up, "weight": weight, "gated": True, "residual": residual}
    return inputs, F.linear(F.silu(gate) * up, weight) + residual


def timed(fn) -> float:
    """Median seconds of one call, replayed in a CUDA graph."""
    import triton.testing

    fn()
    fn()  # compile, autotune
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") / 1e3


def quantized(weight: torch.Tensor, scheme: str) -> torch.nn.Linear:
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="cuda")
    linear.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    config = (
        Int8WeightOnlyConfig(set_inductor_config=False)
        if scheme == "int8"
        else Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    )
    quantize_(linear, config)
    return linear


def nbytes(module) -> int:
    from lmforge.generate.generate import weight_bytes

    return weight_bytes(module)


KERNELS: tuple[str, ...] = ()  # --kernels: the rows whose label starts with one of these (all: ())


def rows_for(name: str, n: int, k: int, m: int) -> list[dict]:
    from lmforge.generate.kernels import QuantizedLinear, gemv

    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = []

    def row(label, fn, num_bytes, reference=None):
        if KERNELS and not label.startswith(KERNELS):
            return
        try:
            seconds = timed(fn)
            entry = {
                "shape": name,
                "n": n,
                "k": k,
                "rows": m,
                "kernel": label,
                "us": round(seconds * 1e6, 2),
                "gb_s": round(num_bytes / seconds / 1e9),
            }
            if reference is not None:
                got, want = fn().float(), reference.float()
                entry["max_rel_err"] = float(((got - want).abs().max() / want.abs().max()).item())
        except Exception as err:  # one failing kernel must not lose the others
            entry = {
                "shape": name,
                "rows": m,
                "kernel": label,
                "error": f"{type(err).__name__}: {err}"[:300],
            }
        print(json.dumps(entry), flush=True)
        out.append(entry)

    bf16_bytes = weight.numel() * 2
    row("bf16 cublas", lambda: F.linear(x, weight), bf16_bytes)
    if m == 1:
        tuned = torch.compile(
            lambda a, b: F.linear(a, b), options={"coordinate_descent_tuning": True}
        )
        row("bf16 inductor", lambda: tuned(x, weight), bf16_bytes)
        row("bf16 lmforge", lambda: gemv(x, weight), bf16_bytes, reference=F.linear(x, weight))
        fused = FUSED.get(name.split()[-1])
        if fused is not None:  # as the engine's fused blocks call it
            inputs, reference = fused_inputs(fused, x, weight)
            row(f"bf16 lmforge {fused}", lambda: gemv(**inputs), bf16_bytes, reference=reference)
    for scheme in ("int8", "int4"):
        linear = quantized(weight, scheme)
        scheme_bytes = nbytes(linear)
        reference = linear(x)
        if scheme == "int8":
            compiled = torch.compile(linear, options={"coordinate_descent_tuning": m == 1})
            row("int8 torchao", lambda c=compiled: c(x), scheme_bytes)
        else:
            row("int4 tinygemm", lambda lin=linear: lin(x), scheme_bytes)
        ours = QuantizedLinear.from_linear(linear, tinygemm=True)
        if ours is None:
            out.append(
                {"shape": name, "rows": m, "kernel": f"{scheme} lmforge", "error": "not converted"}
            )
            continue
        row(f"{scheme} lmforge", lambda o=ours: o(x), nbytes(ours), reference=reference)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 64, 2048])
    parser.add_argument(
        "--kernels", nargs="+", default=[], help="time only rows whose label starts with these"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    global KERNELS
    KERNELS = tuple(args.kernels)
    results = []
    for preset in args.shapes:
        for name, n, k in SHAPES[preset]:
            for m in args.rows:
                if m == 2048 and name not in ("w13", "w2"):
                    continue  # prefill: two shapes say enough
                results += rows_for(f"{preset} {name}", n, k, m)
    Path(args.out, "gemv.json").write_text(json.dumps(results, indent=1))
    print("\n| shape | rows | kernel | µs | GB/s | max rel. err |\n|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['shape']} | {r['rows']} | {r['kernel']} | {r.get('us', r.get('error', ''))} | "
            f"{r.get('gb_s', '')} | {r.get('max_rel_err', '')} |"
        )


if __name__ == "__main__":
    main()
