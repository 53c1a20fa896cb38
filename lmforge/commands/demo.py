"""`lmforge demo`: the embedded default pipeline, `lmforge run examples/tiny/pipeline.toml`.

From nothing to a pretrained, finetuned, aligned, evaluated and quantized tiny model on the CPU
(a few minutes on two cores), ending with the report's location. `--write-data DIR` writes the
demo world's data files (`lmforge.data.demo.write_demo_data`); `--config FILE` does the same
with the settings in FILE, which is what the pipeline's first stage runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lmforge
from lmforge.errors import UserError

DEMO_PIPELINE = Path(lmforge.__file__).resolve().parent.parent / "examples/tiny/pipeline.toml"


def register(subparsers) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="run the embedded tiny pipeline on the CPU (examples/tiny/pipeline.toml)",
        description="Run the embedded demo pipeline: generate the demo world's data, train a "
        "tokenizer, pretrain the tiny preset, finetune it with LoRA, align it with DPO and, "
        "from SFT, with GRPO (exact-match reward), evaluate base vs SFT vs DPO vs GRPO, "
        "quantize the DPO model to int8 and int4, evaluate those, generate a "
        "sample and write the report. Same as `lmforge run examples/tiny/pipeline.toml`; "
        "stages already up to date are skipped.",
    )
    demo.add_argument("--dry-run", action="store_true", help="print the plan only")
    demo.add_argument("--from", dest="from_stage", metavar="STAGE", help="rerun from STAGE")
    demo.add_argument(
        "--write-data",
        type=Path,
        metavar="DIR",
        help="only write the demo world's data files into DIR (the pipeline's first stage)",
    )
    demo.add_argument("--seed", type=int, default=0, help="with --write-data")
    demo.add_argument("--num-people", type=int, default=None, help="with --write-data")
    demo.add_argument("--repeats", type=int, default=None, help="with --write-data")
    demo.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="write the demo world's data files as FILE says (keys: out, seed, num_people, "
        "repeats), as a pipeline's prepare stage with demo = {...} does",
    )
    demo.set_defaults(func=demo_main)


def demo_main(args: argparse.Namespace) -> int:
    if args.config is not None:
        from lmforge.config import load_config
        from lmforge.pipeline.kinds import DemoDataSection

        given = (args.write_data, args.num_people, args.repeats, args.seed or None)
        if any(value is not None for value in given):
            raise UserError(
                f"--config {args.config} gives the settings; do not also give --write-data, "
                "--seed, --num-people or --repeats"
            )
        cfg = load_config(DemoDataSection, args.config)
        args.write_data, args.seed = Path(cfg.out), cfg.seed
        args.num_people, args.repeats = cfg.num_people, cfg.repeats
    if args.write_data is not None:
        from lmforge.data.demo import write_demo_data

        options = {
            k: v
            for k, v in (("num_people", args.num_people), ("repeats", args.repeats))
            if v is not None
        }
        paths = write_demo_data(args.write_data, seed=args.seed, **options)
        for name, path in paths.items():
            print(f"{name}: {path}")
        return 0

    from lmforge.pipeline import run_pipeline

    if not DEMO_PIPELINE.is_file():
        raise UserError(
            f"the demo pipeline {DEMO_PIPELINE} is missing: run lmforge demo from a clone of the "
            "lmforge repository (the file lives in examples/tiny/)"
        )
    result = run_pipeline(DEMO_PIPELINE, from_stage=args.from_stage, dry_run=args.dry_run)
    if result.report is not None:
        print(f"\nThe demo's report: {result.report}")
    return 0 if result.ok else 1
