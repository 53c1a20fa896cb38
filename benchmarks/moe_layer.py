"""One Mixture-of-Experts feed-forward (lmforge/models/moe.py) at a preset's shapes on the GPU:
the grouped path (tokens sorted by expert on the device, one `torch._grouped_mm` a projection)
against the per-expert loop, forward (with and without autograd) and forward + backward, bf16,
with CUDA events (median of --repeats), and the grouped path's error against the loop's output.
At small token counts also the engine's fused path (lmforge/generate/kernels/moe.py: two Triton
kernels reading only the chosen experts' rows; forward without autograd only), on both sides of
its threshold (`FUSED_PAIRS`, raised here so that it runs), and its error against the loop's.
Tokens/s and the experts' TFLOP/s (the routed tokens' SwiGLU products only).

    python3 benchmarks/moe_layer.py --preset qwen3-30b-a3b --tokens 1 8 16 512 16384
"""

from __future__ import annotations

import argparse
import copy
import statistics
from functools import partial

import torch

from lmforge.generate.kernels import moe as moe_kernels
from lmforge.models import get_preset
from lmforge.models.moe import MoEFeedForward

# The fused path runs at token counts of at most this many (token, expert) pairs: up to 4x the
# engine's threshold, so that the rows show where it stops paying.
FUSED_UP_TO = 4 * moe_kernels.FUSED_PAIRS


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


@torch.no_grad()
def inference(layer, x) -> torch.Tensor:
    return layer(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 512, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    a = get_preset(args.preset)
    layer = MoEFeedForward(
        a.dim, a.moe_ffn_dim, a.num_experts, a.num_experts_per_tok, norm_topk_prob=True
    ).to("cuda", torch.bfloat16)
    layer.init_weights(0.02, 0.02)
    fused = copy.deepcopy(layer)  # its experts' class swapped as the engine swaps it
    assert moe_kernels.use_fused_experts(fused) == 1
    moe_kernels.FUSED_PAIRS = FUSED_UP_TO
    k, e = a.num_experts_per_tok, a.num_experts
    print(f"{args.preset}: {e} experts, top {k}, dim {a.dim}, expert ffn {a.moe_ffn_dim}; ms")
    print(f"{'tokens':>7} {'path':>8} {'forward':>9} {'no-grad':>9} {'fwd+bwd':>9} "
          f"{'tok/s f+b':>11} {'TFLOP/s':>8}")  # fmt: skip
    for tokens in args.tokens:
        x = torch.randn(tokens, a.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        outputs = {}
        for path, grouped in (("grouped", True), ("loop", False)):
            layer.experts.grouped = grouped
            outputs[path] = inference(layer, x)
            forward = timed(partial(layer, x), args.repeats)
            no_grad = timed(partial(inference, layer, x), args.repeats)
            both = timed(partial(backward, layer, x), args.repeats)
            flops = 3 * 2 * tokens * k * 3 * a.dim * a.moe_ffn_dim  # fwd + 2x bwd, 3 products
            print(f"{tokens:>7} {path:>8} {forward:>9.3f} {no_grad:>9.3f} {both:>9.3f} "
                  f"{tokens / both * 1e3:>11,.0f} {flops / both / 1e9:>8.1f}", flush=True)  # fmt: skip
        if tokens * k <= FUSED_UP_TO:
            outputs["fused"] = inference(fused, x)
            no_grad = timed(partial(inference, fused, x), args.repeats)
            print(f"{tokens:>7} {'fused':>8} {'-':>9} {no_grad:>9.3f} {'-':>9} {'-':>11} "
                  f"{'-':>8}", flush=True)  # fmt: skip
        ref = outputs["loop"].float()
        for path in [path for path in ("grouped", "fused") if path in outputs]:
            error = ((outputs[path].float() - ref).norm() / ref.norm()).item()
            print(f"{tokens:>7} {path} vs loop: relative error {error:.2e}", flush=True)


if __name__ == "__main__":
    main()
