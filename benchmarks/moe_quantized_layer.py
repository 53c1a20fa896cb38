"""A Mixture-of-Experts layer's quantized experts at a preset's shapes on the GPU: the engine's
fused kernels (lmforge/generate/kernels/moe.py, reading the integers) against the other path
(`moe.dequantize` of every expert, then the grouped products), at 1-64 tokens, bf16
activations, CUDA events (median of --repeats); each fused output's relative error against the
loop over the dequantized weights. int8 a scale a row, int4 two a byte a scale per 128 columns
(as a compressed-tensors artifact holds them), MXFP4 (gpt-oss's hub layout). Where the fused
rows stay faster is where `QUANTIZED_FUSED_PAIRS` belongs.

    python3 benchmarks/moe_quantized_layer.py --preset qwen3-30b-a3b --tokens 1 8 16 32 64
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch

from benchmarks.moe_layer import timed
from lmforge.generate.kernels import moe as moe_kernels
from lmforge.models import get_preset, moe
from lmforge.quantize.stored import pack_int4


def quantized(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A stack [E, rows, cols] as `QuantizedExperts` holds it: (values, scales)."""
    if scheme == "mxfp4":  # random e2m1 nibbles, power-of-two scales a group of 32
        nibbles = torch.randint(0, 16, weight.shape, device=weight.device, dtype=torch.int8)
        scales = torch.randint(118, 124, (*weight.shape[:-1], weight.shape[-1] // 32))
        return pack_int4((nibbles ^ 8) - 8), scales.to(torch.uint8).to(weight.device)
    group = weight.shape[-1] if scheme == "int8" else 128
    top = 127.0 if scheme == "int8" else 7.0
    grouped = weight.float().unflatten(-1, (-1, group))
    scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-8) / top
    values = (grouped / scale).round().clamp(-top - 1, top).flatten(-2).to(torch.int8)
    packed = pack_int4(values) if scheme == "int4" else values
    return packed, scale.squeeze(-1).to(weight.dtype)


def fused(x, weights, chosen, stacks) -> torch.Tensor:
    q13, s13, q2, s2 = stacks
    return moe_kernels.fused_experts(x, q13, q2, weights, chosen, s13, s2)


def dequantized(x, weights, chosen, stacks) -> torch.Tensor:
    """The other path: every expert dequantized, then the grouped products."""
    q13, s13, q2, s2 = stacks
    a13, a2 = moe.dequantize(q13, s13, x.dtype), moe.dequantize(q2, s2, x.dtype)
    return moe.expert_outputs(x, a13, a2, weights, chosen, grouped=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--schemes", nargs="+", default=["int8", "int4", "mxfp4"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    cfg = get_preset(args.preset)
    dim, ffn, experts, top_k = cfg.dim, cfg.moe_ffn_dim, cfg.num_experts, cfg.num_experts_per_tok
    device, rows = torch.device("cuda"), []
    generator = torch.Generator(device).manual_seed(0)
    w13 = torch.randn(experts, 2 * ffn, dim, device=device, generator=generator) / dim**0.5
    w2 = torch.randn(experts, dim, ffn, device=device, generator=generator) / ffn**0.5
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    for scheme in args.schemes:
        (q13, s13), (q2, s2) = quantized(w13, scheme), quantized(w2, scheme)
        stacks = q13, s13, q2, s2
        d13 = moe.dequantize(q13, s13, torch.bfloat16)
        d2 = moe.dequantize(q2, s2, torch.bfloat16)
        for tokens in args.tokens:
            x = torch.randn(tokens, dim, device=device, generator=generator).bfloat16()
            logits = torch.randn(tokens, experts, device=device, generator=generator)
            weights, chosen = moe.route(logits, top_k, norm_topk_prob=True)
            weights = weights.bfloat16()

            with torch.no_grad():
                want = moe.experts_loop(x.float(), d13.float(), d2.float(), weights.float(), chosen)
                got = fused(x, weights, chosen, stacks).float()
                row = {"scheme": scheme, "tokens": tokens, "pairs": tokens * top_k,
                       "fused_ms": timed(partial(fused, x, weights, chosen, stacks), args.repeats),
                       "dequantized_ms": timed(
                           partial(dequantized, x, weights, chosen, stacks), args.repeats),
                       "fused_error": ((got - want).norm() / want.norm()).item()}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "moe_quantized_layer.json"), "w") as file:
        json.dump({"preset": args.preset, "rows": rows}, file, indent=1)
    print("scheme tokens: fused ms / dequantized ms (error)")
    for r in rows:
        print(f"{r['scheme']:6s} {r['tokens']:3d}: {r['fused_ms']:.3f} / "
              f"{r['dequantized_ms']:.3f} ({r['fused_error']:.1e})")  # fmt: skip


if __name__ == "__main__":
    main()
