"""Peak GPU memory of real training steps vs `lmforge plan`'s prediction.

Each configuration builds the model as the trainer does, runs a few `Trainer.train_step`s on
random tokens (fp32 masters, bf16 compute, fused AdamW) and compares the steady steps'
`torch.cuda.max_memory_allocated()` with `plan_memory(...).peak_allocated` (target ±15%), and
the peak reservation plus what lives outside the allocator with the plan's total. "fsdp1" rows
run FSDP2 on a one-rank group (the multi-GPU code path). Writes $OUT/memory.json.

    python benchmarks/memory.py --only 1b-full-none 3b-lora-none

Fills docs/benchmarks.md's "Planner" table (`bash benchmarks/device_calls.sh memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from benchmarks import common
from lmforge.models.llama import get_preset
from lmforge.modules.lora import DEFAULT_TARGETS
from lmforge.parallel.config import ParallelSection
from lmforge.plan.memory import CUDA_CONTEXT_BYTES, GiB, Setup, plan_memory
from lmforge.train.losses import CausalLMLoss, DPOLossStep, count_label_tokens, count_pairs


@dataclass(frozen=True)
class Config:
    name: str
    model: str
    method: str = "full"  # full | lora | qlora | dpo-lora | dpo-full
    ac: str = "none"
    batch: int = 8
    seq: int = 2048
    fsdp1: bool = False  # FSDP2 on a one-rank group
    offload: bool = False
    compile: bool = False
    accumulation: int = 1  # micro-batches per optimizer step


CONFIGS = [
    Config("1b-full-none", "1b", ac="none", batch=8),
    Config("1b-full-selective", "1b", ac="selective", batch=8),
    Config("1b-full-full", "1b", ac="full", batch=16),
    Config("1b-lora-none", "1b", method="lora", ac="none", batch=8),
    Config("1b-lora-full", "1b", method="lora", ac="full", batch=16),
    Config("3b-full-none", "3b", ac="none", batch=4),
    Config("3b-full-full", "3b", ac="full", batch=8),
    Config("3b-lora-none", "3b", method="lora", ac="none", batch=4),
    Config("3b-lora-selective", "3b", method="lora", ac="selective", batch=8),
    Config("1b-dpo-lora-none", "1b", method="dpo-lora", ac="none", batch=4),
    Config("3b-qlora-full", "3b", method="qlora", ac="full", batch=8),
    Config("1b-full-none-fsdp1", "1b", ac="none", batch=8, fsdp1=True),
    Config("3b-full-full-fsdp1", "3b", ac="full", batch=8, fsdp1=True),
    Config("3b-full-full-offload", "3b", ac="full", batch=8, offload=True),
    Config("1b-full-none-compile", "1b", ac="none", batch=8, compile=True),
    Config("1b-dpo-full-none", "1b", method="dpo-full", ac="none", batch=2),
    Config("3b-lora-none-fsdp1", "3b", method="lora", ac="none", batch=4, fsdp1=True),
    Config("1b-full-selective-fsdp1", "1b", ac="selective", batch=8, fsdp1=True),
    Config("1b-full-full-fsdp1-accum2", "1b", ac="full", batch=8, fsdp1=True, accumulation=2),
]


def build_trainer(cfg: Config, device: torch.device, steps: int):
    args = get_preset(common.PRESETS[cfg.model])
    layout = common.one_rank_layout(device, mesh=cfg.fsdp1 or cfg.offload)
    parallel = ParallelSection(
        activation_checkpointing=cfg.ac,
        cpu_offload=cfg.offload,
        compile=cfg.compile,
        reshard_after_forward=True,  # what the planner's Setup models
    )
    lora = "qlora" if cfg.method == "qlora" else "lora" if "lora" in cfg.method else None
    model = common.build_train_model(args, layout, parallel, lora=lora, fsdp1=cfg.fsdp1)
    model.train()
    dpo = cfg.method.startswith("dpo")
    if dpo:
        reference = None
        if cfg.method == "dpo-full":  # lmforge.train.dpo: a frozen copy built like the policy
            reference = common.build_train_model(args, layout, parallel, fsdp1=cfg.fsdp1)
            reference.eval().requires_grad_(False)
        loss_step = DPOLossStep(
            beta=0.1, label_smoothing=0.0, loss_type="sigmoid", reference=reference
        )
        count = count_pairs
    else:
        loss_step, count = CausalLMLoss(compile=cfg.compile), count_label_tokens
    batches = common.random_batches(args.vocab_size, cfg.batch, cfg.seq, device, pairs=dpo)
    trainer = common.bench_trainer(
        model,
        layout,
        loss_step=loss_step,
        batches=batches,
        steps=steps,
        micro_batch_size=cfg.batch,
        accumulation=cfg.accumulation,
        lr=1e-5,
        count_targets=count,
    )
    return trainer, args


def measure(cfg: Config, device: torch.device, steps: int) -> dict:
    common.cleanup()
    start = time.perf_counter()
    trainer, args = build_trainer(cfg, device, steps)
    losses, peak = [], 0
    for _ in range(steps):  # the peak of a steady step (optimizer states exist from step 2)
        torch.cuda.reset_peak_memory_stats()
        losses.append(trainer.train_step(False)["loss"])
        peak = max(peak, torch.cuda.max_memory_allocated())
    setup = Setup(  # what the planner predicts for the same job
        args=args,
        model_name=common.PRESETS[cfg.model],
        method=cfg.method,
        lora_rank=common.LORA_RANK,
        lora_targets=tuple(DEFAULT_TARGETS),
        gpus=1,
        activation_checkpointing=cfg.ac,
        cpu_offload=cfg.offload,
        compile=cfg.compile,
        micro_batch_size=cfg.batch,
        seq_len=cfg.seq,
        force_fsdp=cfg.fsdp1,
        compute_dtype="bf16",
        grad_accumulation=cfg.accumulation,
    )
    plan = plan_memory(setup, "h200")
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    # what lives outside the caching allocator (CUDA context, NCCL buffers)
    outside = (total - free) - torch.cuda.memory_reserved()
    return {
        "config": cfg.name,
        "seconds": round(time.perf_counter() - start, 1),
        "loss": round(losses[-1], 3),
        "predicted_peak_gib": round(plan.peak_allocated / GiB, 2),
        "predicted_total_gib": round(plan.total / GiB, 2),
        "predicted_phase": plan.peak_phase,
        "predicted_components_gib": {
            k: round(v / GiB, 2) for k, v in plan.phases[plan.peak_phase].items()
        },
        "measured_peak_gib": round(peak / GiB, 2),
        "measured_total_gib": round((reserved + outside) / GiB, 2),
        "peak_error_pct": round(100 * (plan.peak_allocated - peak) / peak, 1),
        "total_error_pct": round(100 * (plan.total - reserved - outside) / (reserved + outside), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", help="configuration names")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    known = {c.name: c for c in CONFIGS}
    unknown = [n for n in args.only or [] if n not in known]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {', '.join(known)}")
    configs = [known[n] for n in args.only] if args.only else CONFIGS
    device = torch.device("cuda")
    torch.cuda.init()
    torch.empty(1, device=device)
    free, total = torch.cuda.mem_get_info()
    context = (total - free) / GiB
    print(
        f"{torch.cuda.get_device_name()}: {total / GiB:.1f} GiB, CUDA context "
        f"{context:.2f} GiB (planner assumes {CUDA_CONTEXT_BYTES / GiB:.2f})",
        flush=True,
    )
    rows = []
    for cfg in configs:
        try:
            row = measure(cfg, device, args.steps)
        except Exception as err:  # one failing configuration must not lose the others
            row = {"config": cfg.name, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        common.cleanup()
        print(json.dumps(row), flush=True)
        rows.append(row)
        summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        # after each row: a killed run still leaves what it measured
        common.write_json(
            args.out, "memory.json", {**summary, "context_gib": context, "rows": rows}
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    print(
        f"\n{'config':24s} {'predicted':>10s} {'measured':>10s} {'error':>7s}   "
        f"{'pred. total':>11s} {'measured':>9s} {'error':>7s}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['config']:24s} FAILED {row['error'][:80]}")
        else:
            print(
                f"{row['config']:24s} {row['predicted_peak_gib']:8.2f}Gi {row['measured_peak_gib']:8.2f}Gi "
                f"{row['peak_error_pct']:+6.1f}%   {row['predicted_total_gib']:9.2f}Gi "
                f"{row['measured_total_gib']:7.2f}Gi {row['total_error_pct']:+6.1f}%"
            )


if __name__ == "__main__":
    main()
