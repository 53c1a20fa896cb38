"""Scoring speed, as lm-eval's `loglikelihood` drives it: `sequence_logprobs` over
multiple-choice-like requests (contexts of 20-60 tokens, 1-5 scored tokens, batches of 8),
eager against padded CUDA-graph forwards, on the same random model; prints requests/s for each
and the largest difference between their log-probabilities, in bf16 (where a padded shape's
other GEMM kernels round differently) and in float32 (where the two must agree).

    python3 benchmarks/score_speed.py --preset llama3.2-1b
"""

from __future__ import annotations

import argparse
import time

import torch

from lmforge.api import build_model
from lmforge.generate.logprobs import sequence_logprobs
from lmforge.models.llama import get_preset


def requests(count: int, vocab: int) -> list[tuple[list[int], int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 61, (count,), generator=generator).tolist()
    scored = torch.randint(1, 6, (count,), generator=generator).tolist()
    return [
        (torch.randint(0, vocab, (n,), generator=generator).tolist(), k)
        for n, k in zip(lengths, scored)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    config = get_preset(args.preset)
    work = requests(args.requests, config.vocab_size)
    for dtype in (torch.bfloat16, torch.float32):
        model = build_model(config, device="cuda", dtype=dtype, seed=0).eval()
        results = {}
        for graphs in (False, True, False, True):  # the first of each warms up (and records)
            torch.cuda.synchronize()
            start = time.perf_counter()
            scores = sequence_logprobs(
                model, work, batch_size=args.batch_size, device="cuda", graphs=graphs
            )
            seconds = time.perf_counter() - start
            results[graphs] = (scores, seconds)
        eager, graphed = results[False], results[True]
        diff = max(abs(a[0] - b[0]) for a, b in zip(eager[0], graphed[0]))
        flips = sum(a[1] != b[1] for a, b in zip(eager[0], graphed[0]))
        print(
            f"{args.preset} {str(dtype).removeprefix('torch.')}, {args.requests} requests, "
            f"batch {args.batch_size}: eager {args.requests / eager[1]:.0f} requests/s, "
            f"graphs {args.requests / graphed[1]:.0f} requests/s "
            f"({eager[1] / graphed[1]:.2f}x); largest log-probability difference {diff:.2e}; "
            f"greedy flags differing {flips}",
            flush=True,
        )
        del model, results
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
