"""AdamW's update alone, on a preset's parameter shapes (fp32 parameters, gradients and moments,
as the trainer keeps them): PyTorch's fused kernel, its foreach path, and lmforge's compiled
update (`optim.compile`), with gradient clipping as the fused kernel's divisor and the
found-inf flag handed over as the trainer does. Prints ms per step and the bandwidth each
reaches (7 fp32 reads and writes per parameter: parameter, gradient and both moments read,
parameter and moments written) and the memory a step takes beyond the state it keeps.

    python3 benchmarks/optimizer_step.py --presets llama3.2-1b llama3.2-3b
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from lmforge.models.llama import Transformer, get_preset
from lmforge.train.config import OptimSection
from lmforge.train.optim import build_optimizer

BYTES_PER_PARAM = 7 * 4


def make_optimizer(preset: str, variant: str, device: str = "cuda") -> torch.optim.Optimizer:
    with torch.device("meta"):
        model = Transformer(get_preset(preset))
    model.to_empty(device=device)
    model.tie_weights()
    for param in model.parameters():
        param.data.normal_(std=0.02)
        param.grad = torch.randn_like(param) * 1e-3
    cfg = OptimSection(lr=1e-4, fused=variant == "fused", compile=variant == "compiled")
    return build_optimizer(model, cfg, torch.device(device))


def step_ms(optimizer: torch.optim.Optimizer, iterations: int = 20) -> float:
    device = torch.device("cuda")
    fused_api = optimizer.param_groups[0]["fused"]

    def step():
        if fused_api:  # as the trainer hands them over
            optimizer.grad_scale = torch.full((), 1.5, device=device)
            optimizer.found_inf = torch.zeros((), device=device)
        optimizer.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["llama3.2-1b", "llama3.2-3b"])
    parser.add_argument("--variants", nargs="+", default=["fused", "foreach", "compiled"])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    for preset in args.presets:
        for variant in args.variants:
            optimizer = make_optimizer(preset, variant)
            params = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
            ms = step_ms(optimizer)
            held = torch.cuda.memory_allocated()
            extra = (torch.cuda.max_memory_allocated() - held) / 1e9
            row = {
                "preset": preset,
                "variant": variant,
                "params": params,
                "ms": round(ms, 2),
                "tb_per_s": round(params * BYTES_PER_PARAM / ms / 1e9, 2),
                "temporary_gb": round(extra, 2),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            del optimizer
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "optimizer_step.json"), "w") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, handle, indent=1)
    print(f"\n{'preset':14s} {'variant':10s} {'ms/step':>8s} {'TB/s':>6s} {'extra GB':>8s}")
    for row in rows:
        print(
            f"{row['preset']:14s} {row['variant']:10s} {row['ms']:8.2f} {row['tb_per_s']:6.2f}"
            f" {row['temporary_gb']:8.2f}"
        )


if __name__ == "__main__":
    main()
