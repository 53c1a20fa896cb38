"""Drawing a step's tokens for many sampled rows: one sampler call per row, each with its own
generator (the engine's way before session 10, and still a seeded row's), against one call
over the whole batch from one generator (unseeded rows now), for top-p (a sort of the whole
vocabulary), top-k (the largest k logits only) and both. Random logits of the Llama 3
vocabulary; prints milliseconds a step, host (until the launches return) and done (after a
device sync), median of --steps.

    python3 benchmarks/sample_speed.py --rows 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmforge.generate import Sampler, SamplingParams


def timed(step, steps: int, device: torch.device) -> tuple[float, float]:
    hosts, totals = [], []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - start)
        torch.cuda.synchronize(device)
        totals.append(time.perf_counter() - start)
    return 1000 * statistics.median(hosts), 1000 * statistics.median(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    logits = torch.randn(args.rows, args.vocab, device=device)
    shared = torch.Generator(device=device).manual_seed(0)
    settings = {
        "top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
        "top-k 50": SamplingParams(temperature=1.0, top_k=50),
        "top-k 50, top-p 0.95": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    }
    for setting, params in settings.items():
        own = [Sampler([params], device=device) for _ in range(args.rows)]
        draws = [torch.Generator(device=device).manual_seed(i) for i in range(args.rows)]

        def per_row(own=own, draws=draws) -> None:
            chosen = logits.argmax(dim=-1)
            for i in range(args.rows):
                chosen[i] = own[i](logits[i : i + 1], draws[i])[0]

        def batched(params=params) -> None:
            Sampler([params] * args.rows, device=device)(logits, shared)

        for name, step in (("per row", per_row), ("batched", batched)):
            timed(step, 3, device)  # warm-up
            host, done = timed(step, args.steps, device)
            print(
                f"{args.rows} rows, {setting}, {name}: host {host:.2f} ms, done {done:.2f} ms "
                "a step",
                flush=True,
            )


if __name__ == "__main__":
    main()
