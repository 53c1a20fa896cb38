"""Where a batch-1 decode step's time goes: times the compiled decode step alone (CUDA events,
no sampling or Python bookkeeping) against the whole generation loop, and prints the top CUDA
kernels of a few loop steps from torch.profiler. Use with TORCH_LOGS=recompiles,perf_hints to
see recompilations and skipped CUDA graphs.

    python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 int8-wo
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.decode import SCHEMES, make_model
from lmforge.generate import Generator, SamplingParams


def step_ms(generator: Generator, iterations: int = 50) -> float:
    for _ in range(5):
        generator.engine.decode_rows(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        generator.engine.decode_rows(1)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument(
        "--schemes", nargs="+", default=["bf16", "int8-wo"], choices=sorted(SCHEMES)
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    for scheme in args.schemes:
        model = make_model(args.preset, scheme)
        generator = Generator(
            model, max_batch=1, max_seq_len=16 + args.new_tokens, device="cuda", compile=True
        )
        generator.warmup()
        decode_only = step_ms(generator)
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, stop_token_ids=())
        prompt = list(range(1, 17))
        generator.generate([prompt], params)
        loop = generator.generate([prompt], params).stats
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            generator.generate(
                [prompt], SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=())
            )
        print(
            f"\n== {scheme}: compiled step alone {decode_only:.3f} ms; loop {1000 / loop.decode_tokens_per_s:.3f} ms/token"
        )
        print(
            prof.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60
            )
        )
        print(
            prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60
            )
        )
        del generator, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
