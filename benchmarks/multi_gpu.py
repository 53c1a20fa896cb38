"""Training through the real CLI on one and two GPUs: `lmforge launch --nproc N pretrain|sft|dpo`
on real token shards, SFT and DPO files, as a user runs it. Each row: median tokens/s after
warm-up, the peak memory (max allocated) and the planner's allocated bytes for the same job
(`lmforge plan --config <run>/job.toml`, the total less its context/slack line).

Fills docs/benchmarks.md's "Training through the CLI, one GPU" rows (`bash
benchmarks/device_calls.sh cli`, `cli-post`) and its "Multi-GPU" table (`fsdp2`, `fsdp2-post`).

Rows are PRESET-LAYOUT[-KIND][+nrs|+rs][+bf16r]: layout 1, 2 (FSDP2), tp2 or ep2 (FSDP2 with the
experts split over both GPUs, parallel.ep=2: preset moe only); kind pretrain
(default), sft-full, sft-lora, sft-qlora, dpo-full or dpo-lora; +nrs / +rs set
parallel.reshard_after_forward false / true (default auto); +bf16r parallel.reduce_dtype=bfloat16.
Preset moe is qwen3-30b-a3b cut to MOE_LAYERS blocks (128 experts, top-8), without compile in
every layout (expert parallelism does not take it yet), `bash benchmarks/device_calls.sh moe-2gpu`.
Data: a generated corpus and a BPE tokenizer (vocab 8192; the model keeps its 128256-row table).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

PRESETS = {
    "1b": "llama3.2-1b",
    "3b": "llama3.2-3b",
    "8b": "llama3.1-8b",
    "tiny": "tiny",
    "moe": "qwen3-30b-a3b",
}
MICRO_BATCH = {"1b": 8, "3b": 4, "8b": 2, "tiny": 4, "moe": 4}
MOE_LAYERS = 4  # ~2.7B parameters: fp32 weights, gradients and AdamW fit one GPU
GIB = 2**30


def write_data(root: Path, seq_len: int) -> dict[str, Path]:
    """A random-word corpus, its tokenizer and shards; SFT and DPO rows about seq_len long."""
    from lmforge.data.prepare import PrepareSection, prepare
    from lmforge.data.tokenizer import train_bpe

    paths = {name: root / name for name in ("tokenizer", "shards", "sft.jsonl", "dpo.jsonl")}
    if all(path.exists() for path in paths.values()):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]  # fmt: skip

    def text(num_words: int) -> str:
        return " ".join(rng.choice(words) for _ in range(num_words))

    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(text(400) for _ in range(2000)) + "\n")
    train_bpe([corpus], vocab_size=8192, out_dir=root / "tokenizer")
    prepare(PrepareSection(input=[str(corpus)], tokenizer=str(root / "tokenizer"),
                           out=str(root / "shards"), text_split="paragraph"))  # fmt: skip
    words_per_row = seq_len // 3  # ~1.5 tokens a word: a row fills about half the window
    with (root / "sft.jsonl").open("w") as out:
        for _ in range(256):
            row = {"instruction": text(words_per_row // 4), "output": text(3 * words_per_row // 4)}
            out.write(json.dumps(row) + "\n")
    with (root / "dpo.jsonl").open("w") as out:
        for _ in range(256):
            prompt = text(words_per_row // 4)
            row = {"prompt": prompt, "chosen": text(words_per_row // 2),
                   "rejected": text(words_per_row // 2)}  # fmt: skip
            out.write(json.dumps(row) + "\n")
    return paths


OPTIONS = {  # row suffixes: +nrs, +rs, +bf16r
    "nrs": "parallel.reshard_after_forward=false",
    "rs": "parallel.reshard_after_forward=true",
    "bf16r": "parallel.reduce_dtype=bfloat16",
}


def row_command(row: str, data: dict, run_dir: Path, args) -> tuple[int, list[str]]:
    row, *options = row.split("+")
    size, layout, *kind = row.split("-", 2)
    kind = kind[0] if kind else "pretrain"
    nproc = 1 if layout == "1" else 2
    compile_ = args.device == "cuda" and size != "moe"
    stage = kind.split("-")[0]
    micro = MICRO_BATCH[size] if stage != "dpo" else max(1, MICRO_BATCH[size] // 2)
    keys = [
        f"run_dir={run_dir}",
        f"model.source={PRESETS[size]}",
        f"model.tokenizer={data['tokenizer']}",
        f"model.overrides.vocab_size={8192 if size == 'tiny' else 128256}",
        f"train.steps={args.steps}",
        f"train.micro_batch_size={micro}",
        f"train.device={args.device}",
        "scheduler.warmup_steps=2",
        "metrics.log_every=1",
        "metrics.tensorboard=false",
        "checkpoint.every=0",
        "checkpoint.export_dtype=bfloat16",
        f"parallel.compile={str(compile_).lower()}",
    ]
    if size == "moe":
        keys.append(f"model.overrides.num_layers={MOE_LAYERS}")
    keys += [OPTIONS[option] for option in options]
    if layout == "tp2":
        keys += ["parallel.tp=2", "parallel.dp_shard=1"]
    if layout == "ep2":
        keys.append("parallel.ep=2")
    if stage == "pretrain":
        keys += [f"data.shards={data['shards']}", f"data.seq_len={args.seq_len}"]
    else:
        path = data["sft.jsonl" if stage == "sft" else "dpo.jsonl"]
        keys += [f"data.path={path}", f"data.max_seq_len={args.seq_len}"]
        if kind.endswith("lora"):
            keys += ["lora.enabled=true", "lora.rank=16",
                     'lora.targets=["q","k","v","o","gate","up","down"]']  # fmt: skip
        keys.append("data.pack=true" if stage == "sft" else "data.pad_to_max_seq_len=true")
        if kind == "sft-qlora":
            keys.append('lora.quantize_base="nf4"')
    launch = [sys.executable, "-m", "lmforge", "launch", "--nproc", str(nproc), stage]
    return nproc, launch + keys


def measured(run_dir: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > warmup]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "peak_gib": max(r["peak_mem_gb"] for r in records) * 1e9 / GIB,
        "loss_first_last": (records[0]["loss"], records[-1]["loss"]),
    }


def planned(run_dir: Path, nproc: int) -> dict:
    """The planner's per-GPU total and its allocated part (total less context and slack)."""
    command = [sys.executable, "-m", "lmforge", "plan", "--config", str(run_dir / "job.toml")]
    command += ["--gpus", str(nproc), "--gpu-memory", "141GB"]
    text = subprocess.run(command, capture_output=True, text=True).stdout
    total = re.search(r"total\s+([\d.]+) GiB", text)
    slack = re.search(r"CUDA context, NCCL, allocator slack\s+([\d.]+)", text)
    if not total:
        return {"plan_text": text}
    allocated = float(total.group(1)) - (float(slack.group(1)) if slack else 0.0)
    return {"plan_total_gib": float(total.group(1)), "plan_allocated_gib": allocated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=["1b-1", "1b-2", "3b-1", "3b-2", "3b-tp2"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lmforge-multi-gpu"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    data = write_data(args.work / "data", args.seq_len)
    results = {}
    for row in args.rows:
        run_dir = args.work / row
        nproc, command = row_command(row, data, run_dir, args)
        log = args.out / f"{row.replace('+', '_')}.log"  # $OUT returns plain names only
        with log.open("w") as out:
            code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT)
        if code != 0:
            results[row] = {"error": f"exit {code}: " + log.read_text()[-600:]}
        else:
            results[row] = {**measured(run_dir, args.warmup), **planned(run_dir, nproc)}
            choice = re.search(r"reshard_after_forward = auto -> (\w+)", log.read_text())
            if choice:
                results[row]["reshard_after_forward"] = choice.group(1)
        print(row, json.dumps(results[row]), flush=True)
        for name in ("checkpoints", "artifact"):  # a 3B row leaves ~40 GB
            shutil.rmtree(run_dir / name, ignore_errors=True)
    (args.out / "multi_gpu.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| row | tokens/s | vs 1 GPU | peak GiB | planner GiB (allocated) |\n|---|---|---|---|---|"
    )
    for row, r in results.items():
        one = results.get(re.sub(r"-2|-tp2|-ep2", "-1", row.split("+")[0]), {}).get("tokens_per_s")
        ratio = f"{r['tokens_per_s'] / one:.3f}x" if one and "error" not in r else ""
        cells = [r.get("error", "")[-200:]] if "error" in r else [f"{r['tokens_per_s']:,.0f}"]
        cells += [ratio, f"{r.get('peak_gib', 0):.1f}", f"{r.get('plan_allocated_gib', 0):.1f}"]
        print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
