"""Which tiles `_gemv` should try: every product of the 1B and 3B presets at one row, bf16 and
int8 (one scale a row), plain and with the work a fused decode block gives it (the norm, SiLU·up,
the residual add), timed over a wide grid of tiles (rows × columns, warps, stages, x as a tile
or a vector). Prints, per product, the best tile of the grid against the best of the tiles the
autotuner tries today (`_candidates`), so that the candidate lists can follow the measurement.

Compiling the grid is most of the work: worker processes compile it into Triton's cache in
parallel (each launching the kernel once), then one process times every tile as the autotuner
does, with L2 flushed before each launch.

    python benchmarks/gemv_search.py --out $OUT          # writes gemv_search.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from functools import cache
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (product, N, K, fused work as the engine's blocks give it)
PRODUCTS = [
    ("1b wqkv", 3072, 2048, "norm"),
    ("1b wo", 2048, 2048, "residual"),
    ("1b w13", 16384, 2048, "norm"),
    ("1b w2", 2048, 8192, "gated+residual"),
    ("1b output", 128256, 2048, ""),
    ("3b wqkv", 5120, 3072, "norm"),
    ("3b wo", 3072, 3072, "residual"),
    ("3b w13", 16384, 3072, "norm"),
    ("3b w2", 3072, 8192, "gated+residual"),
]
TILES = [  # (BLOCK_N, BLOCK_K): 1K-32K elements
    (n, k) for n in (2, 4, 8, 16, 32) for k in (512, 1024, 2048) if 1024 <= n * k <= 32768
]


def grid_configs(k: int, fused: str) -> list[dict]:
    return [
        {"BLOCK_N": n, "BLOCK_K": width, "X_TILE": tile, "num_warps": w, "num_stages": s}
        for (n, width), w, s, tile in itertools.product(TILES, (4, 8), (1, 3), (False, True))
        if k % width == 0 and not (tile and "gated" in fused)
    ]


@cache
def inputs(n: int, k: int, bits: int, fused: str) -> dict:
    """`_gemv`'s tensor arguments and flags for one product."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2 * k if "gated" in fused else k, device="cuda", generator=g)
    args = {"x_ptr": x.bfloat16()}
    if bits == 16:
        args["w_ptr"] = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        args["scale_ptr"] = args["zero_ptr"] = x.bfloat16()
    else:
        args["w_ptr"] = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
        args["scale_ptr"] = torch.rand(n, 1, device="cuda", generator=g) * 1e-3
        args["zero_ptr"] = args["scale_ptr"]
    args["norm_ptr"] = torch.rand(k, device="cuda", generator=g).bfloat16()
    args["residual_ptr"] = torch.randn(n, device="cuda", generator=g).bfloat16()
    args["y_ptr"] = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    flags = {"NORM": "norm" in fused, "GATED": "gated" in fused, "RESIDUAL": "residual" in fused}
    launch = {"EARLY": False, "PRELOAD": 0}  # launched in order, each product alone
    return {**args, "N": n, "K": k, "eps": 1e-5, "GROUP": k, "BITS": bits, **flags, **launch}


def cases() -> list[tuple]:
    """(product, n, k, bits, fused) for every product, bf16 and int8, plain and fused."""
    out = []
    for (name, n, k, fused), bits in itertools.product(PRODUCTS, (16, 8)):
        out += [(name, n, k, bits, flavor) for flavor in dict.fromkeys(["", fused])]
    return out


def launch(case: tuple, config: dict, rows: int | None = None) -> None:
    """One launch of `_gemv` for `case` (with `rows` outputs instead of its N: compiling)."""
    from lmforge.generate.kernels.gemv_kernel import _gemv

    _, n, k, bits, fused = case
    n = rows or n
    meta = {key: config[key] for key in ("BLOCK_N", "BLOCK_K", "X_TILE")}
    options = {key: config[key] for key in ("num_warps", "num_stages")}
    _gemv[(-(-n // meta["BLOCK_N"]),)](**inputs(n, k, bits, fused), **meta, **options)


def compile_share(share: list[tuple]) -> int:
    """A worker: compile (launch once) its share of (case, config) pairs."""
    failed = 0
    for case, config in share:
        try:
            launch(case, config, rows=256)  # the same kernel (N is not a constant): less memory
        except Exception:  # e.g. out of registers or shared memory: timed as missing
            failed += 1
    torch.cuda.synchronize()
    return failed


def timed(case: tuple, config: dict) -> float:
    """Median microseconds of a launch with L2 flushed before each (`triton.testing.do_bench`,
    as the autotuner times): in a decode step every weight comes from memory. (Replaying 50
    launches back to back, as the first version did, leaves weights under ~50 MB in L2.)"""
    import triton.testing

    return triton.testing.do_bench(lambda: launch(case, config), warmup=5, rep=20) * 1e3


def autotuner_choices(case: tuple) -> set[tuple]:
    """The tiles the engine's autotuner tries for this product where none is pinned (int8
    exact: this search launches it so)."""
    from lmforge.generate.kernels import tiles

    _, n, k, bits, fused = case
    candidates = tiles._candidates(tiles._gemv_configs(), inputs(n, k, bits, fused))
    kept = [c for c in candidates if not c.kwargs["INT8_BIASED"]]
    return {
        (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["X_TILE"], c.num_warps, c.num_stages)
        for c in kept
    }


def key(config: dict) -> tuple:
    return tuple(config[k] for k in ("BLOCK_N", "BLOCK_K", "X_TILE", "num_warps", "num_stages"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--products", nargs="+", help="names in PRODUCTS (default: all)")
    parser.add_argument(
        "--deadline", type=float, help="seconds; then the products left are skipped"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    started = time.monotonic()
    chosen = [c for c in cases() if not args.products or c[0] in args.products]
    pairs = [(case, config) for case in chosen for config in grid_configs(case[2], case[4])]
    # One compile per distinct kernel: the cases share them across shapes of one flavor.
    distinct = {}
    for case, config in pairs:
        distinct.setdefault((case[2], case[3], case[4], key(config)), (case, config))  # GROUP = K
    shares = [list(distinct.values())[i :: args.workers] for i in range(args.workers)]
    print(f"{len(pairs)} timings, {len(distinct)} kernels to compile on {args.workers} workers")
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        failed = sum(pool.map(compile_share, shares))
    print(f"compiled ({failed} failed)", flush=True)
    results = []
    for case in chosen:
        if args.deadline and time.monotonic() - started > args.deadline:
            print(f"deadline: {case[0]} and the products after it skipped")
            break
        tried = autotuner_choices(case)
        rows = []
        for config in grid_configs(case[2], case[4]):
            try:
                rows.append({**config, "us": round(timed(case, config), 2)})
            except Exception as err:
                rows.append({**config, "error": type(err).__name__})
        rows = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        ours = [r for r in rows if key(r) in tried]
        name, n, k, bits, fused = case
        weight_bytes = n * k * (2 if bits == 16 else 1)
        entry = {
            "product": name,
            "bits": bits,
            "fused": fused,
            "best": rows[0],
            "best_tried": ours[0] if ours else None,
            "top": rows[:5],
            "gb_s": round(weight_bytes / rows[0]["us"] / 1e3),
        }
        results.append(entry)
        print(json.dumps(entry), flush=True)
    Path(args.out, "gemv_search.json").write_text(json.dumps(results, indent=1))
    print("\n| product | bits | fused | best (µs, tile) | GB/s | best the autotuner tries |")
    print("|---|---|---|---|---|---|")
    for r in results:
        b, t = r["best"], r["best_tried"]

        def show(c):
            tile = "x tile" if c["X_TILE"] else "x vector"
            return (
                f"{c['us']} ({c['BLOCK_N']}×{c['BLOCK_K']}, {c['num_warps']}w, "
                f"{c['num_stages']}s, {tile})"
            )

        print(
            f"| {r['product']} | {r['bits']} | {r['fused'] or '-'} | {show(b)} | {r['gb_s']} | "
            f"{show(t) if t else '-'} |"
        )


if __name__ == "__main__":
    main()
