"""A one-row product on the tensor cores, against lmforge's GEMV (`kernels.gemv`), for every
product of the 1B and 3B presets, bf16 and int8 (one scale a row), with the work the fused
decode blocks give each (the norm, SiLU·up, the residual add).

Why: compiled for sm_90, `_gemv`'s int8 loop spends 6.5-9 instructions a weight (docs/
benchmarks.md, session 15), so the int8 products stream at ~2.5 TB/s where bf16's reach ~3.9:
each thread holds one row of its tile, so x's conversion, the norm's multiply and the int8
conversion are paid for every weight. Here a program broadcasts its x block to the 16 rows of a
tile and multiplies [16, BLOCK_K] by the weight tile [BLOCK_K, BLOCK_N] with `tl.dot`: the
products and their sums are the tensor cores', x's preparation is paid once a column and
program, and an int8 weight costs its conversion to bf16 (2.75 instructions). Counted in sm_90
SASS over a program's rows: int8 4.8 instructions a weight at 64 rows a program, bf16 2.2 at
32. Few rows a program leave few programs for the narrow products (1B wo: 2048 rows), and
SiLU·up is computed by every program: the timing decides.

Measured on an H200 (2026-12-02, docs/benchmarks.md, session 16) it lost: the 1B's four int8
products with their fusions took 92.3 us a layer in this form (w2 with SiLU·up alone 52.6),
where the engine's whole int8 step, 16 layers and the output projection, takes ~0.70 ms. The
`kernels.gemv` column of that run is not a measure: launched early (`launch_pdl`) under
`do_bench`, its times (e.g. 114 us for the 1B's bf16 w13, which the engine's step streams in
~20) include time that is not the kernel's.

    python3 benchmarks/gemv_dot.py                 # on a GPU: the 1B's products
    python3 benchmarks/gemv_dot.py --products "3b w13" "3b w2"
    TRITON_INTERPRET=1 python3 benchmarks/gemv_dot.py --check   # the CPU: equal to the reference
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemv_search import PRODUCTS
from lmforge.generate import kernels
from lmforge.generate.kernels.int8 import _int8_values
from lmforge.generate.kernels.shared import _activation

TILE_ROWS = tl.constexpr(16)  # x broadcast to a tile of 16 rows: tl.dot's least


@triton.jit
def _gemv_dot(
    x_ptr,  # [K] activations; [2K] (gate, up) when GATED
    w_ptr,  # [N, K] bf16 or int8
    scale_ptr,  # [N] (int8)
    norm_ptr,  # [K] (NORM)
    residual_ptr,  # [N] (RESIDUAL)
    y_ptr,  # [N]
    N,
    eps,
    K: tl.constexpr,
    BITS: tl.constexpr,
    NORM: tl.constexpr,
    GATED: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT: tl.constexpr,  # float32 dots (the interpreter, whose bf16 dots are wrong)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    dtype: tl.constexpr = tl.float32 if EXACT else tl.bfloat16
    acc = tl.zeros([TILE_ROWS, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)  # of x (NORM)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x, squares = _activation(x_ptr, norm_ptr, cols, K, squares, NORM, GATED)
        x_tile = tl.broadcast_to(x.to(dtype)[None, :], (TILE_ROWS, BLOCK_K))
        w = tl.load(
            w_ptr + rows[:, None] * K + cols[None, :],
            mask=row_ok[:, None],
            other=0,
            eviction_policy="evict_first",
        )
        if BITS == 8:
            w = _int8_values(w)  # exact in bf16 too
        w = tl.trans(w.to(dtype))  # [BLOCK_K, BLOCK_N]
        if EXACT:
            acc = tl.dot(x_tile, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_tile, w, acc)
    y = tl.sum(tl.where(tl.arange(0, TILE_ROWS)[:, None] == 0, acc, 0.0), axis=0)  # row 0
    if NORM:
        y *= 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    if BITS == 8:
        y *= tl.load(scale_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    if RESIDUAL:
        residual = tl.load(residual_ptr + rows, mask=row_ok, other=0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + residual
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


CONFIGS = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages): 12, so that the 1B compiles in minutes
    (n, k, 4, s) for n, k, s in itertools.product((16, 32, 64), (128, 256), (3, 4))
]


def product_inputs(n: int, k: int, bits: int, fused: str, device: str) -> dict:
    """`kernels.gemv`'s arguments for one product (random, seeded)."""
    g = torch.Generator().manual_seed(n + k + bits)
    x = torch.randn(1, 2 * k if "gated" in fused else k, generator=g).bfloat16()
    if bits == 16:
        weight, scale = (torch.randn(n, k, generator=g) * 0.02).bfloat16(), None
    else:
        weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale = (torch.rand(n, 1, generator=g) * 1e-3 + 1e-4).bfloat16()
    norm = (1 + 0.1 * torch.randn(k, generator=g)).bfloat16() if "norm" in fused else None
    residual = torch.randn(n, generator=g).bfloat16() if "residual" in fused else None
    to = {"device": device}
    return {
        "x": x.to(**to),
        "weight": weight.to(**to),
        "scale": scale.to(**to) if scale is not None else None,
        "norm": norm.to(**to) if norm is not None else None,
        "residual": residual.to(**to) if residual is not None else None,
        "gated": "gated" in fused,
        "bits": bits,
    }


def run_dot(inputs: dict, config: tuple) -> torch.Tensor:
    block_n, block_k, warps, stages = config
    weight = inputs["weight"]
    n, k = weight.shape
    y = torch.empty(1, n, dtype=inputs["x"].dtype, device=weight.device)
    any_ptr = y
    interpreted = kernels.INTERPRETED
    options = {} if interpreted else {"num_warps": warps, "num_stages": stages}
    _gemv_dot[(triton.cdiv(n, block_n),)](
        inputs["x"],
        weight,
        inputs["scale"] if inputs["scale"] is not None else any_ptr,
        inputs["norm"] if inputs["norm"] is not None else any_ptr,
        inputs["residual"] if inputs["residual"] is not None else any_ptr,
        y,
        n,
        1e-5,
        K=k,
        BITS=inputs["bits"],
        NORM=inputs["norm"] is not None,
        GATED=inputs["gated"],
        RESIDUAL=inputs["residual"] is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EXACT=interpreted,
        **options,
    )
    return y


def run_gemv(inputs: dict) -> torch.Tensor:
    return kernels.gemv(
        inputs["x"],
        inputs["weight"],
        inputs["scale"],
        None,
        inputs["bits"],
        inputs["norm"],
        1e-5,
        inputs["gated"],
        inputs["residual"],
    )


def check() -> None:
    """On the CPU (Triton's interpreter): the dot form equals `kernels.gemv` for every fusion."""
    for bits, fused in itertools.product((16, 8), ("", "norm", "gated+residual", "residual")):
        inputs = product_inputs(40, 256, bits, fused, "cpu")
        want = run_gemv(inputs).float()
        got = run_dot(inputs, (32, 128, 4, 2)).float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    print("the dot form equals kernels.gemv: bf16 and int8, plain, norm, gated+residual, residual")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="the CPU check (interpreter)")
    parser.add_argument(
        "--products",
        nargs="+",
        default=[name for name, *_ in PRODUCTS if name.startswith("1b")],
        help="names as in gemv_search.PRODUCTS (default: the 1B's)",
    )
    parser.add_argument("--bits", nargs="+", type=int, default=[16, 8], choices=[16, 8])
    parser.add_argument(
        "--quick", action="store_true", help="three tiles, and each product's fused work only"
    )
    args = parser.parse_args()
    configs = [(32, 256, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3)] if args.quick else CONFIGS
    if args.check:
        return check()
    print(
        "| product | bits | fused | kernels.gemv µs | dot µs (rows, cols, warps, stages) | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for name, n, k, fused in PRODUCTS:
        if name not in args.products:
            continue
        for bits in args.bits:
            for work in [fused] if args.quick else sorted({"", fused}):
                inputs = product_inputs(n, k, bits, work, "cuda")
                want = run_gemv(inputs).float()
                ours = triton.testing.do_bench(partial(run_gemv, inputs), warmup=5, rep=30)
                timings = {}
                for config in configs:
                    if k % config[1]:
                        continue
                    got = run_dot(inputs, config).float()
                    scale = want.abs().max().item()
                    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)
                    bench = partial(run_dot, inputs, config)
                    timings[config] = triton.testing.do_bench(bench, warmup=5, rep=30)
                best = min(timings, key=timings.get)
                print(
                    f"| {name} | {bits} | {work or '-'} | {ours * 1e3:.2f} | "
                    f"{timings[best] * 1e3:.2f} {best} | {ours / timings[best]:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
