"""`lmforge run PIPELINE.toml`, `lmforge status [RUN_DIR]` and `lmforge report RUN_DIR`.

Each stage of a pipeline runs as `lmforge COMMAND --config stage.toml` (lmforge.pipeline.kinds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RUN_EPILOG = """\
examples:
  lmforge run examples/tiny/pipeline.toml                 # the embedded demo, on this machine
  lmforge run pipeline.toml --dry-run --launcher slurm    # print the sbatch scripts
  lmforge run pipeline.toml --from sft                    # rerun sft and every stage after it
  lmforge run pipeline.toml --only eval

A stage whose config and inputs are unchanged since its last success is skipped ("up to date");
a stage that runs makes every stage downstream of it run. Secrets (HF_TOKEN, WANDB_API_KEY,
LMFORGE_API_KEY) come from the environment or --secrets-file and reach the stages through their
environment only.
"""


def register(subparsers) -> None:
    run = subparsers.add_parser(
        "run",
        help="run a pipeline file: every stage in order, skipping those up to date",
        description="Run the stages of a pipeline file (prepare, tokenizer, pretrain, sft, dpo, grpo, "
        "eval, quantize, generate, export), each in runs/<pipeline>/<stage>/ with a manifest, "
        "each stage's output feeding the next.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("pipeline", type=Path, metavar="PIPELINE.toml|yaml")
    run.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="changes to the pipeline file, e.g. stages.sft.train.steps=10",
    )
    run.add_argument(
        "--launcher",
        choices=["local", "slurm", "k8s"],
        default="local",
        help="where stages run (default: local)",
    )
    which = run.add_mutually_exclusive_group()
    which.add_argument(
        "--from",
        dest="from_stage",
        metavar="STAGE",
        help="run STAGE and every stage after it, up to date or not",
    )
    which.add_argument("--only", metavar="STAGE", help="run only STAGE (its inputs must exist)")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and each stage's command / scripts; run nothing",
    )
    run.add_argument(
        "--secrets-file",
        type=Path,
        metavar="FILE",
        help="NAME=VALUE lines for HF_TOKEN, WANDB_API_KEY, LMFORGE_API_KEY",
    )
    run.add_argument(
        "--no-wait",
        action="store_true",
        help="slurm / k8s: return once submitted (follow with lmforge status)",
    )
    run.set_defaults(func=run_main)

    status = subparsers.add_parser(
        "status",
        help="show each stage's state, timings and key metrics of a pipeline run",
        description="Print every stage of a run directory (runs/<pipeline>): its state (and "
        "the scheduler's, for Slurm / Kubernetes jobs), when it ran, how long it took, its key "
        "metrics, or why it failed or did not start.",
    )
    status.add_argument(
        "run_dir",
        type=Path,
        nargs="?",
        metavar="RUN_DIR",
        help="default: the run directory under ./runs that `lmforge run` wrote to last",
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--no-refresh", action="store_true", help="do not ask the scheduler about unfinished jobs"
    )
    status.set_defaults(func=status_main)

    report = subparsers.add_parser(
        "report",
        help="write an HTML page and a markdown summary of a pipeline run",
        description="One self-contained HTML page (plots embedded) and a markdown summary of a "
        "run directory: loss curves, evaluations before/after each stage, throughput and MFU, "
        "artifact sizes, the artifacts' lineage and a generated sample.",
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    report.add_argument("--out", type=Path, help="directory to write to (default: RUN_DIR)")
    report.set_defaults(func=report_main)


def run_main(args: argparse.Namespace) -> int:
    from lmforge.pipeline import run_pipeline

    result = run_pipeline(
        args.pipeline,
        launcher=args.launcher,
        from_stage=args.from_stage,
        only=args.only,
        dry_run=args.dry_run,
        secrets_file=args.secrets_file,
        wait=not args.no_wait,
        overrides=args.overrides,
    )
    return 0 if result.ok or (args.no_wait and not result.handles) else 1


def status_main(args: argparse.Namespace) -> int:
    import dataclasses

    from lmforge.pipeline import format_status, latest_run_dir, pipeline_status

    run_dir = args.run_dir
    if run_dir is None:
        run_dir = latest_run_dir()
        print(f"status of {run_dir} (the run written last)", file=sys.stderr)
    statuses = pipeline_status(run_dir, refresh=not args.no_refresh)
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in statuses], indent=2, default=str))
    else:
        print(format_status(statuses))
    return 0 if all(s.status in ("succeeded", "skipped") for s in statuses) else 1


def report_main(args: argparse.Namespace) -> int:
    from lmforge.report import write_report

    paths = write_report(args.run_dir, out=args.out)
    print(f"report: {paths['html']}")
    print(f"summary: {paths['markdown']}")
    return 0
