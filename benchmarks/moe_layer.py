"""One Mixture-of-Experts feed-forward (lmforge/models/moe.py) at a preset's shapes on the GPU:
the grouped path (tokens sorted by expert on the device, one `torch._grouped_mm` a projection)
against the per-expert loop, forward and forward + backward, bf16, with CUDA events (median
of --repeats), and the grouped path's error against the loop's output. Tokens/s and the
experts' TFLOP/s (the routed tokens' SwiGLU products only).

    python3 benchmarks/moe_layer.py --preset qwen3-30b-a3b --tokens 16384
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from lmforge.models import get_preset
from lmforge.models.moe import MoEFeedForward


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() on the GPU (three warm-up calls first)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def backward(layer, x) -> None:
    layer(x).sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 512, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    a = get_preset(args.preset)
    layer = MoEFeedForward(
        a.dim, a.moe_ffn_dim, a.num_experts, a.num_experts_per_tok, norm_topk_prob=True
    ).to("cuda", torch.bfloat16)
    layer.init_weights(0.02, 0.02)
    k, e = a.num_experts_per_tok, a.num_experts
    print(f"{args.preset}: {e} experts, top {k}, dim {a.dim}, expert ffn {a.moe_ffn_dim}; ms")
    print(
        f"{'tokens':>7} {'path':>8} {'forward':>9} {'fwd+bwd':>9} {'tok/s f+b':>11} {'TFLOP/s':>8}"
    )
    for tokens in args.tokens:
        x = torch.randn(tokens, a.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        outputs = {}
        for path, grouped in (("grouped", True), ("loop", False)):
            layer.experts.grouped = grouped
            with torch.no_grad():
                outputs[path] = layer(x)
            forward = timed(partial(layer, x), args.repeats)
            both = timed(partial(backward, layer, x), args.repeats)
            flops = 3 * 2 * tokens * k * 3 * a.dim * a.moe_ffn_dim  # fwd + 2x bwd, 3 products
            print(f"{tokens:>7} {path:>8} {forward:>9.3f} {both:>9.3f} "
                  f"{tokens / both * 1e3:>11,.0f} {flops / both / 1e9:>8.1f}", flush=True)  # fmt: skip
        ref = outputs["loop"].float()
        error = ((outputs["grouped"].float() - ref).norm() / ref.norm()).item()
        print(f"{tokens:>7} grouped vs loop: relative error {error:.2e}", flush=True)


if __name__ == "__main__":
    main()
