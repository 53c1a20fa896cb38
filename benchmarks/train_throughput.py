"""Training throughput on one GPU: lmforge's training step (`Trainer.train_step` after
`parallelize()`, random tokens, bf16 compute) on a preset's shape and batch. Prints a table of
tokens/s, MFU (on the active parameters' FLOPs, `ModelArgs.flops_per_token`) and peak memory.

Fills docs/benchmarks.md's "Training, one GPU" table (`bash benchmarks/device_calls.sh train`),
its LoRA / QLoRA rows (`device_calls.sh lora`), the MoE row beside torchtitan's Qwen3-MoE
(`device_calls.sh moe-train`: shape moe, qwen3-30b-a3b, with --num-layers 4; its aux loss and
expert-load counts on, as the training commands run it) and the MoE LoRA row beside
transformers + PEFT (`device_calls.sh moe-lora`; on a MoE -lora adapts attention and the
experts). A variant is ours-compile or ours-eager with any of -float8, -sac (selective
activation checkpointing), -lora or -qlora (rank 16, QLoRA's base in NF4) and -bf16p (bf16
weights, fp32 masters; without it fp32 weights under autocast). --device cpu with --override
(model fields, e.g. dim=64) checks a small shape runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from benchmarks import common
from lmforge.models import get_preset
from lmforge.parallel.config import ParallelSection
from lmforge.train.losses import CausalLMLoss

PEAK_FLOPS = 989e12


def model_overrides(args) -> dict:
    """--num-layers and --override KEY=VALUE as ModelArgs fields (numbers where they parse)."""
    changes = {"num_layers": args.num_layers} if args.num_layers else {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--override {item!r}: expected KEY=VALUE, e.g. dim=64")
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                pass
        changes[key] = value
    return changes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_ours(preset: str, batch: int, seq: int, args, variant: str):
    """Seconds a step of `variant`, the preset's ModelArgs (with the overrides) and the number
    of trainable parameters."""
    margs = get_preset(preset).replace(**model_overrides(args))
    compile = "eager" not in variant
    parallel = ParallelSection(
        compile=compile,
        float8="float8" in variant,
        activation_checkpointing="selective" if "sac" in variant else "none",
    )
    lora = "qlora" if "qlora" in variant else "lora" if "lora" in variant else None
    layout = common.one_rank_layout(torch.device(args.device))
    model = common.build_train_model(margs, layout, parallel, lora=lora)
    trainer = common.bench_trainer(
        model,
        layout,
        loss_step=CausalLMLoss(compile=compile, fused=True),
        batches=common.random_batches(margs.vocab_size, batch, seq, layout.device),
        steps=args.steps + args.warmup,
        micro_batch_size=batch,
        bf16_params="bf16p" in variant,
    )
    for _ in range(args.warmup):
        trainer.train_step(False)
    sync(layout.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(False)
    sync(layout.device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (time.perf_counter() - start) / args.steps, margs, trainable


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["1b:8x2048", "3b:4x2048"])
    parser.add_argument(
        "--variants", nargs="+", default=["ours-compile-bf16p", "ours-float8-bf16p"]
    )
    parser.add_argument("--num-layers", type=int, help="shorten the presets to this many blocks")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="cuda", help="cuda; cpu: a check that it runs")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        name, dims = shape.split(":")
        batch, seq = map(int, dims.split("x"))
        for variant in args.variants:
            common.cleanup()  # this variant's peak must not count the last one's state
            try:
                seconds, margs, trainable = bench_ours(
                    common.PRESETS[name], batch, seq, args, variant
                )
            except Exception as err:  # one failing variant must not lose the others' numbers
                print(f"{shape} {variant}: FAILED {type(err).__name__}: {err}", flush=True)
                rows.append({"shape": shape, "variant": variant, "error": str(err)[:200]})
                continue
            tokens = batch * seq / seconds
            mfu = tokens * margs.flops_per_token(seq) / PEAK_FLOPS
            peak = torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else 0.0
            row = {
                "shape": shape,
                "variant": variant,
                "tokens_per_s": round(tokens),
                "mfu": round(mfu, 4),
                "peak_mem_gb": round(peak, 1),
                "step_s": round(seconds, 4),
            }
            if "lora" in variant:  # the adapters' size, to set beside PEFT's (hf_peft_moe.py)
                row["trainable_params"] = trainable
            if margs.num_params(active=True) != margs.num_params():  # a MoE: what MFU counts
                row |= {"num_layers": margs.num_layers, "params": margs.num_params(),
                        "active_params": margs.num_params(include_embedding=False, active=True),
                        "flops_per_token": margs.flops_per_token(seq)}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    summary = {"gpu": gpu, "torch": torch.__version__, "rows": rows}
    common.write_json(args.out, "train_throughput.json", summary)
    print(f"\n{'shape':12s} {'variant':16s} {'tok/s':>9s} {'MFU':>6s} {'peak GB':>8s}")
    for row in rows:
        if "error" in row:
            print(f"{row['shape']:12s} {row['variant']:16s} FAILED")
        else:
            print(
                f"{row['shape']:12s} {row['variant']:16s} {row['tokens_per_s']:9,d} {100 * row['mfu']:5.1f}% {row['peak_mem_gb']:8.1f}"
            )


if __name__ == "__main__":
    main()
