"""`lmforge demo`: the embedded default, from nothing to a trained tiny model on the CPU.

Generates the demo world (lmforge.data.demo), trains its tokenizer, prepares token shards,
pretrains the `tiny` preset, and prints `model info` of the resulting artifact.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def register(subparsers) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="run the embedded tiny demo on the CPU",
        description="Generate the demo world's data, train a tokenizer, prepare shards and "
        "pretrain the tiny preset; prints where everything went.",
    )
    demo.add_argument("--out", type=Path, default=Path("runs/demo"), help="output directory")
    demo.add_argument("--steps", type=int, default=300, help="pretraining steps")
    demo.set_defaults(func=demo_main)


def demo_main(args: argparse.Namespace) -> int:
    from lmforge.commands.model import info_main
    from lmforge.config import load_config
    from lmforge.data.demo import write_demo_data
    from lmforge.data.prepare import PrepareSection, prepare
    from lmforge.data.tokenizer import train_bpe
    from lmforge.train.config import PretrainJob
    from lmforge.train.pretrain import pretrain

    start = time.perf_counter()
    out = args.out
    paths = write_demo_data(out / "data")
    print(f"[demo] data: {out / 'data'}")
    tokenizer_dir = out / "tokenizer"
    train_bpe([paths["corpus"]], vocab_size=1024, out_dir=tokenizer_dir)
    shards = out / "shards"
    if not (shards / "meta.json").exists():
        prepare(PrepareSection(input=[str(paths["corpus"])], tokenizer=str(tokenizer_dir),
                               out=str(shards), text_split="paragraph", workers=1))
    job = load_config(PretrainJob, None, [
        f"run_dir={out / 'pretrain'}", f"data.shards={shards}", f"model.tokenizer={tokenizer_dir}",
        "data.seq_len=128", "train.micro_batch_size=16", f"train.steps={args.steps}",
        "scheduler.warmup_steps=20", "optim.lr=3e-3", "metrics.log_every=25",
        f"checkpoint.every={max(args.steps // 2, 1)}",
    ])
    artifact = pretrain(job)
    print(f"[demo] pretrained artifact: {artifact}")
    info_main(argparse.Namespace(source=str(artifact), seq_len=128, model_config=None))
    print(f"[demo] done in {time.perf_counter() - start:.0f}s")
    return 0
