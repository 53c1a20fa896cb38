"""Where a batch-1 decode step's time goes: times the compiled decode step alone (CUDA events,
no sampling or Python bookkeeping; at the KV lengths a generation of --new-tokens attends to,
weighted by its steps at each) against the whole generation loop, and summarizes a
torch.profiler trace of the compiled steps (GPU span, busy and idle time per step, kernels per
step, the largest kernels). Use with TORCH_LOGS=recompiles,perf_hints to see recompilations and
skipped CUDA graphs.

    python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 int8-wo int4-wo
    python3 benchmarks/decode_profile.py --schemes bf16 --variants default autotune

Variants (each a fresh compile): default (the engine as it is); unfused-blocks (the GEMVs
without the norms, SiLU·up and residual adds inside them: those run as kernels of their own);
no-tuning (no coordinate
descent tuning: inductor keeps bf16 matrix-vector products as cuBLAS calls instead of its own
reductions); wide-tuning (coordinate descent tuning that tries every direction, two steps out,
for better reduction configurations); cublas-output (the output projection an opaque cuBLAS
call); autotune (inductor max-autotune); realize-N (inductor stores pointwise results of more
than N operations, e.g. SiLU·up and the normalized activations, as buffers of their own instead of
recomputing them inside every row of the matrix-vector product that reads them); sdpa-math (attention traced through the math backend,
so inductor writes its kernels; run it with TORCHINDUCTOR_FX_GRAPH_CACHE=0, or the cache may
serve the default graph); attention-split-N (the fused blocks' attention kernel reads at most N
cache slots a program, default 256: more programs, then a kernel that merges them); no-early
(each kernel launched only after the one before has finished; lmforge/generate/early_launch.py);
no-preload (launched early, but the GEMV loads no weights before its wait); preload-1 (one
weight tile before the wait at every width; the engine: bf16 one, int8 two).

Writes one Chrome trace per scheme to --out ($OUT if set).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from pathlib import Path

import torch

from benchmarks.common import autotuned
from benchmarks.decode import SCHEMES, launch_context, make_model
from benchmarks.trace_summary import added_by_kernel, summarize
from lmforge.generate import Generator, SamplingParams


def steps_per_kv_len(generator: Generator, prompt_len: int, new_tokens: int) -> Counter:
    """How many of a generation's decode steps attend to each KV length: its first new token
    comes from the prefill, the others from steps at positions prompt_len, prompt_len+1, ..."""
    positions = range(prompt_len, prompt_len + new_tokens - 1)
    return Counter(generator.engine.kv_bucket(p + 1) for p in positions)


def step_ms(generator: Generator, kv_len: int, iterations: int = 50) -> float:
    for _ in range(5):
        generator.engine.decode_rows(1, kv_len)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        generator.engine.decode_rows(1, kv_len)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def trace_steps(generator: Generator, path: Path, kv_len: int, steps: int = 20) -> None:
    """A Chrome trace of `steps` compiled decode steps, each marked as a profiler step."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"ProfilerStep#{i}"):
                generator.engine.decode_rows(1, kv_len)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


@torch.library.custom_op("lmforge_bench::linear", mutates_args=())
def opaque_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear that inductor cannot see into: it stays one cuBLAS call."""
    return torch.nn.functional.linear(x, weight)


@opaque_linear.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def _patched(module, name: str, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def variant_context(variant: str):
    """What the decode steps compile under, for `variant`."""
    if variant == "autotune":
        return autotuned()
    if variant == "wide-tuning":  # coordinate descent over every direction, two steps out
        return torch._inductor.config.patch(
            coordinate_descent_check_all_directions=True, coordinate_descent_search_radius=2
        )
    if variant.startswith("realize"):  # realize-N: pointwise bodies of more than N ops
        threshold = int(variant.split("-")[1])
        return torch._inductor.config.patch(realize_opcount_threshold=threshold)
    if variant.startswith("attention-split"):  # attention-split-N: N cache slots a program
        from lmforge.generate import decode_attention

        return _patched(decode_attention, "SPLIT_SLOTS", int(variant.rsplit("-", 1)[1]))
    if variant in ("no-early", "no-preload", "preload-1"):
        return launch_context(variant)
    if variant == "sdpa-math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument(
        "--schemes", nargs="+", default=["bf16", "int8-wo"], choices=sorted(SCHEMES)
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["default"],
        choices=[
            "default",
            "unfused-blocks",
            "no-tuning",
            "wide-tuning",
            "cublas-output",
            "autotune",
            "sdpa-math",
            "attention-split-32",
            "attention-split-64",
            "no-early",
            "no-preload",
            "preload-1",
            "realize-0",
            "realize-4",
            "realize-8",
        ],
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for scheme in args.schemes:
        for variant in args.variants:
            profile(args, scheme, variant)


@torch.no_grad()
def profile(args, scheme: str, variant: str) -> None:
    model = make_model(args.preset, scheme)
    if variant == "cublas-output":
        output = model.output
        output.forward = lambda x: opaque_linear(x, output.weight)
    generator = Generator(
        model,
        max_batch=1,
        max_seq_len=16 + args.new_tokens,
        device="cuda",
        compile=True,
        tune_decode=variant != "no-tuning",
        fuse_blocks=variant != "unfused-blocks",
    )
    with variant_context(variant):  # (the graphs record the attention kernel's split)
        generator.warmup()
        # The step alone, at the KV lengths the generation below attends to, weighted as it is.
        prompt = list(range(1, 17))
        kv_steps = steps_per_kv_len(generator, len(prompt), args.new_tokens)
        per_kv = {kv_len: step_ms(generator, kv_len) for kv_len in sorted(kv_steps)}
        decode_only = sum(per_kv[kv_len] * n for kv_len, n in kv_steps.items()) / kv_steps.total()
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, stop_token_ids=())
        generator.generate([prompt], params)
        loop = generator.generate([prompt], params).stats
        name = f"{args.preset}-{scheme}-{variant}"
        trace = args.out / f"decode-{name}.trace.json"
        trace_steps(generator, trace, kv_len=kv_steps.most_common(1)[0][0])
        by_kv = ", ".join(f"{per_kv[kv_len]:.3f} ms at {kv_len} slots" for kv_len in per_kv)
        print(
            f"\n== {name}: compiled step alone {decode_only:.3f} ms ({by_kv}); "
            f"loop {1000 / loop.decode_tokens_per_s:.3f} ms/token",
            flush=True,
        )
    print(summarize(trace, top=14), flush=True)
    print(added_by_kernel(trace), flush=True)
    del generator, model
    torch._dynamo.reset()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
