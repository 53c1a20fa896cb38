"""The GEMV's tiles chosen inside the batch-1 decode step: the tool that writes the table of
pinned tiles lmforge reads at run time (`tiles.TILES`, gemv_tiles.json; `bash
benchmarks/device_calls.sh tiles`). Triton's autotuner times each tile alone; inside the step
the kernels launch early and overlap, and a pick fastest alone can be slow there
(docs/inference.md). After the engine's own tuning, each product's candidate tiles
(`tiles._candidates`, `tiles._int4_configs()` for int4 in packed fp16) go into the step in
turn (its CUDA graph recorded again), timed over --tokens greedy tokens (median of --repeats); a
product keeps its fastest tile before the next is searched (coordinate descent, --passes
rounds). Prints tok/s with the autotuner's and the step's picks, writes both to
tile_search.json in --out and merges the step's into --table. The search starts from the pinned
tiles of the table in use (LMFORGE_GEMV_TILES=none: from the autotuner's picks).

    LMFORGE_GEMV_TILES=none python3 benchmarks/tile_search.py --preset llama3.2-1b --schemes bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode import SCHEMES, copy_bandwidth, make_model
from lmforge.generate import Generator, SamplingParams, kernels, weight_bytes
from lmforge.generate.kernels import gemv_kernel, int4, tiles


def decode_rate(generator: Generator, prompt: list[int], tokens: int, repeats: int) -> float:
    """Median decode tokens/s of a greedy generation of `tokens` tokens."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0, stop_token_ids=())
    runs = [generator.generate([prompt], params) for _ in range(repeats)]
    return statistics.median(r.stats.decode_tokens_per_s for r in runs)


def record_again(generator: Generator) -> None:
    """Drop the decode steps' CUDA graphs: the next step records with the current picks."""
    graphs = generator.engine.graphs.graphs
    for key in [key for key in graphs if key[0] in ("decode", "greedy")]:
        del graphs[key]


def named(key: tuple) -> dict:
    """The autotuner's arguments from its key: the key's values, then its tensors' dtypes (x's
    first), named as the autotuner that holds it names them (`_gemv_int4`'s or `_gemv`'s)."""
    names = (int4._gemv_int4_tuned if _is_int4(key) else gemv_kernel._gemv_tuned).keys
    x = torch.empty(0, dtype=getattr(torch, key[len(names)].removeprefix("torch.")))
    return dict(zip(names, key)) | {"x_ptr": x}


def _is_int4(key: tuple) -> bool:
    return key in int4._gemv_int4_tuned.cache


def candidates(key: tuple, folded: bool = False) -> list:
    """The tiles the autotuner tries for the product of `key` where none is pinned (`folded`:
    only the folded ones, `tiles._ROW_DEEP`)."""
    if _is_int4(key):
        found = tiles._int4_candidates(int4._gemv_int4_tuned.configs, named(key))
    else:
        found = tiles._candidates(gemv_kernel._gemv_tuned.configs, named(key))
    return [c for c in found if c.kwargs.get("FOLD")] if folded else found


describe = tiles.describe


def search(generator, prompt, args, caches: list[dict]) -> float:
    """Coordinate descent over the autotuners' caches (changed in place); returns the final
    rate."""
    rate = decode_rate(generator, prompt, args.tokens, args.repeats)
    pinned = tiles.pinned_tiles(torch.cuda.get_device_name()) if args.unpinned else {}
    keys = [(cache, key) for cache in caches for key in list(cache)]
    keys = [(cache, key) for cache, key in keys if tiles.tile_key(named(key)) not in pinned]
    if args.folded:
        keys = [(cache, key) for cache, key in keys if candidates(key, folded=True)]
    if args.only:
        keys = [(cache, key) for cache, key in keys if args.only in tiles.tile_key(named(key))]
    for round_ in range(args.passes):
        for picks, key in keys:
            best, best_rate = picks[key], rate
            for config in candidates(key, args.folded):
                if describe(config) == describe(best):  # (picks read from disk are copies)
                    continue
                picks[key] = config
                record_again(generator)
                trial = decode_rate(generator, prompt, args.tokens, args.repeats)
                print(f"    tried {tiles.tile_key(named(key))}: {describe(config)} {trial:.1f} tok/s"
                      f" (kept: {best_rate:.1f})", flush=True)  # fmt: skip
                if trial > best_rate * (1 + args.margin):
                    best, best_rate = config, trial
            picks[key] = best
            if best_rate != rate:
                print(f"  pass {round_ + 1} {tiles.tile_key(named(key))}: {describe(best)} "
                      f"{best_rate:.1f} tok/s")  # fmt: skip
            rate = best_rate
        record_again(generator)
        rate = decode_rate(generator, prompt, args.tokens, args.repeats)  # the whole set again
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--schemes", nargs="+", choices=sorted(SCHEMES), default=["bf16"])
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens a timing")
    parser.add_argument("--repeats", type=int, default=3, help="timings a trial (median)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument(
        "--margin", type=float, default=0.005, help="a tile must beat the kept one by this much"
    )
    parser.add_argument(
        "--unpinned",
        action="store_true",
        help="search only the products the table in use does not pin (new ones)",
    )
    parser.add_argument(
        "--folded",
        action="store_true",
        help="search only the products that may fold (int8), among their folded tiles",
    )
    parser.add_argument("--only", default="", help="search only products whose key has this")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--table", default=None, help="a tiles table to merge the step's picks into (made if new)"
    )
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available() or kernels.INTERPRETED:
        parser.error("needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")
    bandwidth = copy_bandwidth()
    prompt = list(range(1000, 1016))
    results = []
    for scheme in args.schemes:
        start = time.perf_counter()
        model = make_model(args.preset, scheme)
        limit = bandwidth / weight_bytes(model)
        generator = Generator(
            model, max_batch=1, max_seq_len=len(prompt) + args.tokens, device="cuda"
        )
        generator.warmup()
        decode_rate(generator, prompt, args.tokens, 1)  # tunes every product, records graphs
        caches = [gemv_kernel._gemv_tuned.cache, int4._gemv_int4_tuned.cache]
        picks = {key: config for cache in caches for key, config in cache.items()}
        tuned = {key: describe(config) for key, config in picks.items()}
        tuned_rate = decode_rate(generator, prompt, args.tokens, args.repeats)
        step_rate = search(generator, prompt, args, caches)
        picks = {key: config for cache in caches for key, config in cache.items()}
        row = {
            "preset": args.preset,
            "scheme": scheme,
            "limit_tok_s": round(limit),
            "autotuner_tok_s": round(tuned_rate, 1),
            "step_tok_s": round(step_rate, 1),
            "seconds": round(time.perf_counter() - start),
            "autotuner_picks": {tiles.tile_key(named(k)): pick for k, pick in tuned.items()},
            "step_picks": {tiles.tile_key(named(k)): describe(c) for k, c in picks.items()},
        }
        print(json.dumps(row), flush=True)
        results.append(row)
        if args.table:  # after each scheme: a later one that runs out of time loses only its own
            merge(Path(args.table), torch.cuda.get_device_name(), [row])
        for cache in caches:  # the next scheme tunes its own products
            cache.clear()
        del generator, model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    (Path(args.out) / "tile_search.json").write_text(json.dumps(results, indent=1))


def merge(path: Path, gpu: str, results: list[dict]) -> None:
    """The step's picks into the table at `path`, under `gpu`."""
    table = json.loads(path.read_text()) if path.exists() else {}
    picks = table.get(gpu, {}) | {k: v for row in results for k, v in row["step_picks"].items()}
    table[gpu] = dict(sorted(picks.items()))
    path.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
