"""Causal attention forward + backward on one GPU, for each SDPA backend, on the training shapes of
the Llama 3.2 presets: which backend `F.scaled_dot_product_attention` picks by default and how fast
each one is, with grouped-query attention as `enable_gqa=True` and with the key/value heads
repeated beforehand (as torchtitan does).

    python benchmarks/attention_backends.py --shapes 1b:8x2048 3b:4x2048
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmforge.models.llama import get_preset

PRESETS = {"1b": "llama3.2-1b", "3b": "llama3.2-3b", "8b": "llama3.1-8b"}
BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def time_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def attention_step(q, k, v, *, repeat_kv: bool, backend):
    groups = q.shape[1] // k.shape[1]

    def step():
        kk, vv = k, v
        if repeat_kv:
            kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        if backend is None:
            out = F.scaled_dot_product_attention(
                q, kk, vv, is_causal=True, enable_gqa=not repeat_kv
            )
        else:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(
                    q, kk, vv, is_causal=True, enable_gqa=not repeat_kv
                )
        out.backward(torch.ones_like(out))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1b:8x2048", "3b:4x2048"])
    args = parser.parse_args()
    print(f"{'shape':12s} {'backend':10s} {'kv':8s} {'ms fwd+bwd':>11s} {'TFLOP/s':>8s}")
    for shape in args.shapes:
        name, dims = shape.split(":")
        batch, seq = map(int, dims.split("x"))
        margs = get_preset(PRESETS[name])
        hd = margs.head_dim

        q, k, v = (
            torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for heads in (margs.num_heads, margs.num_kv_heads, margs.num_kv_heads)
        )
        # causal: half of the 4·b·h·s²·d forward flops, backward 2.5× the forward
        flops = 3.5 * 2 * batch * margs.num_heads * seq * seq * hd
        for label, backend in BACKENDS.items():
            for repeat_kv in (False, True):
                kv = "repeated" if repeat_kv else "gqa"
                try:
                    ms = time_ms(attention_step(q, k, v, repeat_kv=repeat_kv, backend=backend))
                except RuntimeError as err:
                    print(f"{shape:12s} {label:10s} {kv:8s} unsupported: {str(err)[:80]}")
                    continue
                print(f"{shape:12s} {label:10s} {kv:8s} {ms:11.3f} {flops / ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
