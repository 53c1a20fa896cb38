"""Training throughput on one GPU: lmforge's training step (`Trainer.train_step` after
`parallelize()`, random tokens, bf16 compute) on a Llama shape and batch. Prints a table of
tokens/s, MFU and peak memory.

Fills docs/benchmarks.md's "Training, one GPU" table (beside torchtitan 0.2.2, run in the same
device call: `bash benchmarks/device_calls.sh train`) and its LoRA / QLoRA rows
(`device_calls.sh lora`).

    python benchmarks/train_throughput.py --shapes 1b:8x2048 --variants ours-compile-bf16p ours-float8-bf16p

A variant's name says what it runs: ours-compile or ours-eager, with any of -float8, -sac
(selective activation checkpointing), -lora or -qlora (rank 16 on the blocks' seven linears;
QLoRA's frozen base in NF4) and -bf16p (bf16 weights with fp32 masters in the optimizer, as one
GPU trains; without it fp32 weights under autocast).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from benchmarks.common import bench_trainer
from lmforge.models.llama import Transformer, get_preset
from lmforge.parallel.config import ParallelSection
from lmforge.parallel.distributed import Layout
from lmforge.train.losses import CausalLMLoss
from lmforge.train.parallelize import parallelize

PRESETS = {"1b": "llama3.2-1b", "3b": "llama3.2-3b", "8b": "llama3.1-8b"}
PEAK_FLOPS = 989e12


def random_batches(vocab: int, batch: int, seq: int, device):
    generator = torch.Generator(device=device).manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=generator)
        yield {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}


def bench_ours(
    preset: str,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    *,
    compile: bool,
    float8: bool,
    ac: str,
    lora: str | None = None,
    bf16_params: bool = False,
):
    """lora: None (full training), "lora" (rank 16 on every linear of the blocks) or "qlora"
    (the same with the frozen base in NF4)."""
    from lmforge.modules.lora import apply_lora, quantize_base_nf4, reset_lora_parameters

    args = get_preset(preset)
    device = torch.device("cuda")
    layout = Layout(rank=0, world_size=1, device=device, mesh=None, dp_rank=0, dp_size=1, tp_size=1)
    with torch.device("meta"):
        model = Transformer(args)
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    if lora:
        apply_lora(model, targets=targets, rank=16, alpha=32, base_dtype=torch.bfloat16)
    parallel = ParallelSection(compile=compile, float8=float8, activation_checkpointing=ac)
    parallelize(model, layout, parallel, bf16=True)
    model.to_empty(device=device)
    model.tie_weights()
    torch.manual_seed(0)
    model.init_weights()
    if lora:
        reset_lora_parameters(model)
    if lora == "qlora":
        quantize_base_nf4(model)
    trainer = bench_trainer(
        model,
        layout,
        loss_step=CausalLMLoss(compile=compile, fused=True),
        batches=random_batches(args.vocab_size, batch, seq, device),
        steps=steps + warmup,
        micro_batch_size=batch,
        bf16_params=bf16_params,
    )
    return time_steps(lambda: trainer.train_step(False), steps, warmup), args


def time_steps(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


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
            gc.collect()  # this variant's peak must not count the last one's state
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                lora = "qlora" if "qlora" in variant else "lora" if "lora" in variant else None
                seconds, margs = bench_ours(
                    PRESETS[name],
                    batch,
                    seq,
                    args.steps,
                    args.warmup,
                    compile="eager" not in variant,
                    float8="float8" in variant,
                    ac="selective" if "sac" in variant else "none",
                    lora=lora,
                    bf16_params="bf16p" in variant,
                )
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
            gc.collect()
            torch._dynamo.reset()
    with open(os.path.join(args.out, "train_throughput.json"), "w") as handle:
        json.dump(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
            handle,
            indent=1,
        )
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
