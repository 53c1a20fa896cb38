"""The AdamW update alone on one GPU, over a preset's parameter shapes (fp32 parameters,
gradients and moments; gradients divided by a grad_scale and a found_inf handed over, as the
trainer does): PyTorch's fused AdamW against lmforge's Triton update at a few tile sizes.

    python benchmarks/adamw_update.py --preset llama3.2-1b
"""

from __future__ import annotations

import argparse

import torch
import triton

from lmforge.models.llama import Transformer, get_preset
from lmforge.train import adamw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="llama3.2-1b")
    args = parser.parse_args()
    with torch.device("meta"):
        model = Transformer(get_preset(args.preset))
    shapes = [p.shape for p in model.parameters()]
    params = [torch.randn(shape, device="cuda") * 0.02 for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param)
    numel = sum(p.numel() for p in params)
    scale, found_inf = torch.tensor(1.5, device="cuda"), torch.zeros((), device="cuda")

    def timed(optimizer) -> float:
        def step():
            optimizer.grad_scale, optimizer.found_inf = scale, found_inf
            optimizer.step()

        return triton.testing.do_bench(step, warmup=5, rep=200)

    rows = {"torch fused AdamW": timed(torch.optim.AdamW(params, lr=1e-4, fused=True))}
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            adamw.BLOCK, adamw.WARPS = block, warps
            rows[f"Triton, block {block}, {warps} warps"] = timed(adamw.AdamW(params, lr=1e-4))
    print(f"{args.preset}: {len(params)} tensors, {numel / 1e9:.3f}B parameters")
    for name, ms in rows.items():
        print(f"{name:32s} {ms:8.3f} ms  {28 * numel / ms / 1e9:5.2f} TB/s at 28 bytes a parameter")


if __name__ == "__main__":
    main()
