"""Training throughput on one GPU: lmforge's training step (`Trainer.train_step` after
`parallelize()`, random tokens, bf16 compute) on a Llama shape and batch. Prints a table of
tokens/s, MFU and peak memory.

Fills docs/benchmarks.md's "Training, one GPU" table (`bash benchmarks/device_calls.sh train`)
and its LoRA / QLoRA rows (`device_calls.sh lora`). A variant is ours-compile or ours-eager with
any of -float8, -sac (selective activation checkpointing), -lora or -qlora (rank 16, QLoRA's base
in NF4) and -bf16p (bf16 weights, fp32 masters; without it fp32 weights under autocast).
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
from lmforge.models.llama import get_preset
from lmforge.parallel.config import ParallelSection
from lmforge.train.losses import CausalLMLoss

PEAK_FLOPS = 989e12


def bench_ours(preset: str, batch: int, seq: int, args, variant: str):
    """Seconds a step of `variant` and the preset's ModelArgs."""
    margs = get_preset(preset)
    compile = "eager" not in variant
    parallel = ParallelSection(
        compile=compile,
        float8="float8" in variant,
        activation_checkpointing="selective" if "sac" in variant else "none",
    )
    lora = "qlora" if "qlora" in variant else "lora" if "lora" in variant else None
    layout = common.one_rank_layout(torch.device("cuda"))
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
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(False)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.steps, margs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["1b:8x2048", "3b:4x2048"])
    parser.add_argument(
        "--variants", nargs="+", default=["ours-compile-bf16p", "ours-float8-bf16p"]
    )
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
                seconds, margs = bench_ours(common.PRESETS[name], batch, seq, args, variant)
            except Exception as err:  # one failing variant must not lose the others' numbers
                print(f"{shape} {variant}: FAILED {type(err).__name__}: {err}", flush=True)
                rows.append({"shape": shape, "variant": variant, "error": str(err)[:200]})
                continue
            tokens = batch * seq / seconds
            mfu = tokens * margs.flops_per_token(seq) / PEAK_FLOPS
            peak = torch.cuda.max_memory_allocated() / 1e9
            row = {
                "shape": shape,
                "variant": variant,
                "tokens_per_s": round(tokens),
                "mfu": round(mfu, 4),
                "peak_mem_gb": round(peak, 1),
                "step_s": round(seconds, 4),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
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
