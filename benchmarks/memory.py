"""Peak GPU memory of real training steps vs `lmforge plan`'s prediction.

Each configuration builds the model the way the trainer does (meta device → LoRA swap →
`parallelize()` → materialize → init), runs a few `Trainer.train_step`s on random tokens
(fp32 master weights, bf16 compute, fused AdamW), and compares
`torch.cuda.max_memory_allocated()` over the steady steps with `plan_memory(...).peak_allocated`
(target: within ±15% on every row), and the device memory needed (the caching allocator's peak
reservation plus what lives outside it: CUDA context, NCCL) with the plan's total.

    python benchmarks/memory.py                       # all configurations, one GPU
    python benchmarks/memory.py --only 1b-full-none 3b-lora-none

"fsdp1" rows wrap the model in FSDP2 on a one-rank process group: the multi-GPU code path
(bf16 all-gathers, fp32 reduce-scatters, no autocast) on one GPU. Writes $OUT/memory.json.
Fills docs/benchmarks.md's "Planner" table (`bash benchmarks/device_calls.sh memory`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.common import bench_trainer
from lmforge.models.llama import Transformer, get_preset
from lmforge.modules.lora import (
    DEFAULT_TARGETS,
    apply_lora,
    quantize_base_nf4,
    reset_lora_parameters,
)
from lmforge.parallel.config import ParallelSection
from lmforge.parallel.distributed import MESH_AXES, Layout
from lmforge.plan.memory import CUDA_CONTEXT_BYTES, GiB, Setup, plan_memory
from lmforge.train.losses import CausalLMLoss, DPOLossStep, count_label_tokens, count_pairs
from lmforge.train.parallelize import apply_fsdp, parallelize

PRESETS = {"1b": "llama3.2-1b", "3b": "llama3.2-3b", "8b": "llama3.1-8b", "tiny": "tiny"}


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
LORA_RANK = 16


def random_batches(cfg: Config, vocab: int, device):
    generator = torch.Generator(device=device).manual_seed(0)

    def tokens():
        return torch.randint(0, vocab, (cfg.batch, cfg.seq + 1), device=device, generator=generator)

    while True:
        if cfg.method.startswith("dpo"):
            chosen, rejected = tokens(), tokens()
            yield {
                "chosen_inputs": chosen[:, :-1],
                "chosen_labels": chosen[:, 1:],
                "rejected_inputs": rejected[:, :-1],
                "rejected_labels": rejected[:, 1:],
            }
        else:
            t = tokens()
            yield {"inputs": t[:, :-1], "labels": t[:, 1:]}


def one_rank_layout(device: torch.device) -> Layout:
    """A one-process group and (1, 1, 1) mesh, for FSDP2 on one device."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1, 1, 1), mesh_dim_names=MESH_AXES)
    return Layout(rank=0, world_size=1, device=device, mesh=mesh, dp_rank=0, dp_size=1, tp_size=1)


def build_model(cfg: Config, args, layout: Layout, device: torch.device, *, lora: bool):
    """Meta device → LoRA swap → parallelize() → materialize → initialize, as the trainer."""
    with torch.device("meta"):
        model = Transformer(args)
    if lora:
        apply_lora(  # as lmforge.train.stage in bf16 training: frozen linears stored in bf16
            model,
            targets=DEFAULT_TARGETS,
            rank=LORA_RANK,
            alpha=2.0 * LORA_RANK,
            base_dtype=torch.bfloat16 if device.type == "cuda" else None,
        )
    parallel = ParallelSection(
        activation_checkpointing=cfg.ac,
        cpu_offload=cfg.offload,
        compile=cfg.compile,
        reshard_after_forward=True,  # what predict()'s Setup models
    )
    parallelize(model, layout, parallel, bf16=True)
    if cfg.fsdp1 and not cfg.offload:
        apply_fsdp(model, layout, parallel, bf16=True)  # parallelize skips FSDP at dp size 1
    model.to_empty(device="cpu" if cfg.offload else device)
    fsdp = cfg.fsdp1 or cfg.offload
    if not fsdp:
        model.tie_weights()
    model.init_buffers(device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    if lora:
        reset_lora_parameters(model)
    if cfg.method == "qlora":
        quantize_base_nf4(model)
    return model


def build_trainer(cfg: Config, device: torch.device, steps: int):
    args = get_preset(PRESETS[cfg.model])
    on_cuda = device.type == "cuda"
    if cfg.fsdp1 or cfg.offload:
        layout = one_rank_layout(device)
    else:
        layout = Layout(
            rank=0, world_size=1, device=device, mesh=None, dp_rank=0, dp_size=1, tp_size=1
        )
    lora = cfg.method in ("lora", "qlora", "dpo-lora")
    model = build_model(cfg, args, layout, device, lora=lora)
    model.train()
    if cfg.method.startswith("dpo"):
        reference = None
        if cfg.method == "dpo-full":  # lmforge.train.dpo: a frozen copy built like the policy
            reference = build_model(cfg, args, layout, device, lora=False).eval()
            reference.requires_grad_(False)
        loss_step = DPOLossStep(
            beta=0.1, label_smoothing=0.0, loss_type="sigmoid", reference=reference
        )
        count = count_pairs
    else:
        loss_step, count = CausalLMLoss(compile=cfg.compile), count_label_tokens
    trainer = bench_trainer(
        model,
        layout,
        loss_step=loss_step,
        batches=random_batches(cfg, args.vocab_size, device),
        steps=steps,
        micro_batch_size=cfg.batch,
        accumulation=cfg.accumulation,
        bf16=on_cuda,
        lr=1e-5,
        count_targets=count,
    )
    return trainer, args


def predict(cfg: Config, args, *, compute: str = "bf16"):
    setup = Setup(
        args=args,
        model_name=PRESETS[cfg.model],
        method=cfg.method,
        lora_rank=LORA_RANK,
        lora_targets=tuple(DEFAULT_TARGETS),
        gpus=1,
        activation_checkpointing=cfg.ac,
        cpu_offload=cfg.offload,
        compile=cfg.compile,
        micro_batch_size=cfg.batch,
        seq_len=cfg.seq,
        force_fsdp=cfg.fsdp1,
        compute_dtype=compute,
        grad_accumulation=cfg.accumulation,
    )
    return plan_memory(setup, "h200")


def measure(cfg: Config, device: torch.device, steps: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    start = time.perf_counter()
    trainer, args = build_trainer(cfg, device, steps)
    losses, peak = [], 0
    for _ in range(steps):  # the peak of a steady step (optimizer states exist from step 2)
        torch.cuda.reset_peak_memory_stats()
        losses.append(trainer.train_step(False)["loss"])
        peak = max(peak, torch.cuda.max_memory_allocated())
    plan = predict(cfg, args)
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()
    free, total = torch.cuda.mem_get_info()
    # Reserved at its peak, plus what lives outside the caching allocator (CUDA context, NCCL
    # buffers): what the device must hold.
    outside = (total - free) - torch.cuda.memory_reserved()
    row = {
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
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def _write(out: str, device, context, rows) -> None:
    with open(os.path.join(out, "memory.json"), "w") as handle:
        json.dump(
            {
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "context_gib": context,
                "rows": rows,
            },
            handle,
            indent=1,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", help="configuration names")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    configs = CONFIGS
    if args.only:
        known = {c.name: c for c in configs}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            parser.error(f"unknown configurations {unknown}; known: {', '.join(known)}")
        configs = [known[n] for n in args.only]
    device = torch.device("cuda")
    context = None
    if device.type == "cuda":
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
            if device.type == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
        _write(args.out, device, context, rows)  # a killed run still leaves what it measured
    if dist.is_initialized():
        dist.destroy_process_group()
    print(
        f"\n{'config':24s} {'predicted':>10s} {'measured':>10s} {'error':>7s}   "
        f"{'pred. total':>11s} {'measured':>9s} {'error':>7s}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['config']:24s} FAILED {row['error'][:80]}")
        elif "measured_peak_gib" in row:
            print(
                f"{row['config']:24s} {row['predicted_peak_gib']:8.2f}Gi {row['measured_peak_gib']:8.2f}Gi "
                f"{row['peak_error_pct']:+6.1f}%   {row['predicted_total_gib']:9.2f}Gi "
                f"{row['measured_total_gib']:7.2f}Gi {row['total_error_pct']:+6.1f}%"
            )


if __name__ == "__main__":
    main()
