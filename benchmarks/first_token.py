"""Where the time to a generation's first token goes: `Generator.generate` of a short prompt
(batch 1, greedy, two new tokens: the prefill's token and one decode step), repeated, with the
host time of each engine phase (admit, prefill forward, decode step, sampling, the copy to the
host, collecting, which waits for the device) and the eager prefill forward's own host and device
time; then one generation under torch.profiler (the prefill's kernels, the host's largest ops).

    python3 benchmarks/first_token.py --preset llama3.2-1b
    python3 benchmarks/first_token.py --device cpu --preset tiny
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.trace_summary import summarize
from lmforge.api import build_model
from lmforge.generate import Generator, SamplingParams
from lmforge.generate.engine import Engine
from lmforge.models.llama import get_preset

PHASES = ("_admit", "_prefill", "_decode_running", "_sample", "_to_host", "_collect")


def timed_phases(engine: Engine) -> dict[str, list[float]]:
    """Wrap the engine's phases (on this instance) to add each call's host seconds to a list."""
    spent: dict[str, list[float]] = defaultdict(list)

    def wrap(name: str):
        method = getattr(engine, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name].append(time.perf_counter() - start)

        setattr(engine, name, timed)

    for name in PHASES:
        wrap(name)
    return spent


def forward_times(generator: Generator, prompt: list[int], device: str) -> tuple[float, float]:
    """The eager prefill forward alone (the model over the prompt, no cache): host dispatch
    seconds and seconds until the device finished."""
    tokens = torch.tensor([prompt], device=device)
    positions = torch.arange(len(prompt), device=device)[None]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    generator.model(tokens, positions=positions, return_hidden=True)
    dispatched = time.perf_counter()
    sync()
    return dispatched - start, time.perf_counter() - start


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(get_preset(args.preset), device=args.device, dtype=dtype, seed=0).eval()
    generator = Generator(model, max_batch=1, max_seq_len=args.prompt_len + 128, device=args.device)
    start = time.perf_counter()
    generator.warmup()
    print(f"warm-up (compile, CUDA graphs): {time.perf_counter() - start:.1f} s", flush=True)
    prompt = list(range(1, args.prompt_len + 1))
    params = SamplingParams(max_new_tokens=2, temperature=0, stop_token_ids=())
    for _ in range(3):  # allocator, pinned buffers, the prefill's first kernels
        generator.generate([prompt], params)
    spent = timed_phases(generator.engine)
    to_first = [generator.generate([prompt], params).stats.prefill_s for _ in range(args.repeats)]
    print(
        f"\n{args.preset}, prompt {args.prompt_len}: time to the first token "
        f"{1000 * statistics.median(to_first):.2f} ms (median of {args.repeats}; "
        f"min {1000 * min(to_first):.2f})"
    )
    print("host ms per generation (2 tokens), by engine phase:")
    for name in PHASES:
        calls = spent.get(name, [])
        print(
            f"  {name:16s} {1000 * sum(calls) / args.repeats:7.3f}  ({len(calls) / args.repeats:.0f} calls)"
        )
    host, done = zip(*(forward_times(generator, prompt, args.device) for _ in range(10)))
    print(
        f"eager prefill forward alone: host {1000 * statistics.median(host):.2f} ms, "
        f"done after {1000 * statistics.median(done):.2f} ms"
    )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    with profiler as prof, torch.profiler.record_function("ProfilerStep#0"):
        generator.generate([prompt], params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    if args.device == "cuda":
        trace = args.out / f"first-token-{args.preset}.trace.json"
        prof.export_chrome_trace(str(trace))
        print(summarize(trace, top=12), flush=True)


if __name__ == "__main__":
    main()
