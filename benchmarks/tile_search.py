"""The GEMV's tiles chosen inside the batch-1 decode step: the tool that writes the table of
pinned tiles lmforge reads at run time (`tiles.TILES`, gemv_tiles.json; `bash
benchmarks/device_calls.sh tiles`). After the engine's own tuning, each product's candidate
tiles go into the step in turn (its CUDA graph recorded again), timed over --tokens greedy
tokens (median of --repeats); a product keeps its fastest tile before the next is searched
(coordinate descent, --passes rounds). Writes tile_search.json to --out and merges the step's
picks into --table. LMFORGE_GEMV_TILES=none starts from the autotuner's picks (docs/inference.md).
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

from benchmarks.common import cleanup, write_json
from benchmarks.decode import SCHEMES, copy_bandwidth, make_model
from lmforge.generate import Generator, SamplingParams, kernels, weight_bytes
from lmforge.generate.kernels import gemv_kernel, int4, tiles

MARGIN = 0.005  # a tile must beat the kept one by this much
describe = tiles.describe


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
    x, w = (
        torch.empty(0, dtype=getattr(torch, d.removeprefix("torch.")))
        for d in key[len(names) :][:2]
    )
    return dict(zip(names, key)) | {"x_ptr": x, "w_ptr": w}


def _is_int4(key: tuple) -> bool:
    return key in int4._gemv_int4_tuned.cache


def candidates(key: tuple) -> list:
    """The tiles the autotuner tries for the product of `key` where none is pinned."""
    if _is_int4(key):
        return tiles._int4_candidates(int4._gemv_int4_tuned.configs, named(key))
    return tiles._candidates(gemv_kernel._gemv_tuned.configs, named(key))


def search(generator, prompt, args, caches: list[dict]) -> float:
    """Coordinate descent over the autotuners' caches (changed in place) -> the final rate."""
    rate = decode_rate(generator, prompt, args.tokens, args.repeats)
    keys = [(cache, key) for cache in caches for key in list(cache)]
    for round_ in range(args.passes):
        for picks, key in keys:
            best, best_rate = picks[key], rate
            for config in candidates(key):
                if describe(config) == describe(best):  # (picks read from disk are copies)
                    continue
                picks[key] = config
                record_again(generator)
                trial = decode_rate(generator, prompt, args.tokens, args.repeats)
                print(f"    tried {tiles.tile_key(named(key))}: {describe(config)} {trial:.1f} tok/s"
                      f" (kept: {best_rate:.1f})", flush=True)  # fmt: skip
                if trial > best_rate * (1 + MARGIN):
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
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--table", help="a tiles table to merge the step's picks into")
    args = parser.parse_args()
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
        cleanup()
    write_json(args.out, "tile_search.json", results)


def merge(path: Path, gpu: str, results: list[dict]) -> None:
    """The step's picks into the table at `path`, under `gpu`."""
    table = json.loads(path.read_text()) if path.exists() else {}
    picks = table.get(gpu, {}) | {k: v for row in results for k, v in row["step_picks"].items()}
    table[gpu] = dict(sorted(picks.items()))
    path.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
