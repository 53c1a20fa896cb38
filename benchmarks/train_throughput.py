"""Training throughput on one GPU: lmforge's training step vs Hugging Face transformers, side by
side in one run, on the same Llama shape and batch (random tokens, fp32 master weights, bf16
compute, fused AdamW). Prints a table of tokens/s, MFU and peak memory.

    python benchmarks/train_throughput.py --shapes 1b:8x2048 3b:4x2048 --variants ours-compile hf-compile

A variant's name says what it runs: hf-compile or hf-eager (transformers' Llama); ours-compile or
ours-eager, with any of -float8, -sac (selective activation checkpointing), -lora or -qlora,
-autotune (inductor's max-autotune: each GEMM benchmarked among cuBLAS and Triton templates),
-logits (the output projection and the loss apart, the cross entropy compiled: before the fused
loss), -torchadam (PyTorch's fused AdamW instead of lmforge's Triton update) and -bf16p (bf16
weights with fp32 masters in the optimizer, no autocast casts of the weights).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.common import autotuned, bench_trainer
from lmforge.models.llama import Transformer, get_preset
from lmforge.parallel.config import ParallelSection
from lmforge.parallel.distributed import Layout
from lmforge.train import optim
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
    fused_loss: bool = True,
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
        loss_step=CausalLMLoss(compile=compile, fused=fused_loss),
        batches=random_batches(args.vocab_size, batch, seq, device),
        steps=steps + warmup,
        micro_batch_size=batch,
        bf16_params=bf16_params,
    )
    return time_steps(lambda: trainer.train_step(False), steps, warmup), args, trainer


def bench_hf(preset: str, batch: int, seq: int, steps: int, warmup: int, *, compile: bool):
    import transformers

    args = get_preset(preset)
    device = torch.device("cuda")
    scaling = args.rope_scaling
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        },
        max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=args.tie_embeddings,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).to(device)
    model.train()
    if compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = random_batches(args.vocab_size, batch, seq, device)

    def step():
        b = next(batches)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=b["inputs"], labels=b["inputs"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return time_steps(step, steps, warmup), args, step


def time_steps(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def profile_steps(step, trace: str, steps: int = 2) -> None:
    """Trace `steps` more steps (after one untraced) into a Chrome trace at `trace`."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=steps),
        on_trace_ready=lambda prof: prof.export_chrome_trace(trace),
    ) as prof:
        for _ in range(1 + steps):
            step()
            prof.step()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["1b:8x2048", "3b:4x2048"])
    parser.add_argument(
        "--variants", nargs="+", default=["hf-compile", "ours-compile", "ours-eager", "ours-float8"]
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, trace two steps of each variant and print where the GPU time goes",
    )
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        name, dims = shape.split(":")
        batch, seq = map(int, dims.split("x"))
        for variant in args.variants:
            step = trainer = None  # this variant's peak must not count the last one's state
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                if variant.startswith("hf"):
                    seconds, margs, step = bench_hf(
                        PRESETS[name],
                        batch,
                        seq,
                        args.steps,
                        args.warmup,
                        compile=variant.endswith("compile"),
                    )
                else:
                    lora = "qlora" if "qlora" in variant else "lora" if "lora" in variant else None
                    # "autotune": inductor's max-autotune (GEMMs among cuBLAS and Triton)
                    tuning = autotuned() if "autotune" in variant else contextlib.nullcontext()
                    optim.TRITON_ADAMW = "torchadam" not in variant
                    with tuning:
                        seconds, margs, trainer = bench_ours(
                            PRESETS[name],
                            batch,
                            seq,
                            args.steps,
                            args.warmup,
                            compile="eager" not in variant,
                            float8="float8" in variant,
                            ac="selective" if "sac" in variant else "none",
                            lora=lora,
                            fused_loss="logits" not in variant,
                            bf16_params="bf16p" in variant,
                        )
                    step = functools.partial(trainer.train_step, False)
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
            if args.profile:
                from benchmarks.trace_summary import summarize

                trace = os.path.join(args.out, f"trace-{name}-{variant}.json")
                profile_steps(step, trace)
                print(summarize(Path(trace), top=25), flush=True)
                os.remove(trace)  # large; the summary is what the run keeps
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
