"""`lmforge eval ARTIFACT... --tasks ...`: lm-eval tasks and perplexity on one or more models.

`lmforge eval --config FILE` scores the models FILE names side by side into one results.json
(`lmforge.eval.stage`): what a pipeline's eval stage runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from lmforge.commands.common import add_runtime_arguments
from lmforge.errors import ConfigError, UserError

EPILOG = (
    "Tasks are lm-eval names (hellaswag, truthfulqa_mc2, ...; their datasets come from the hub "
    "or its local cache) or local task YAMLs in a directory given with --include-path "
    "(`dataset_path: json` with `dataset_kwargs: {data_files: {test: FILE.jsonl}}` needs no "
    "network). --demo-data FILE adds the demo's tasks demo_mc (plain prompt) and demo_mc_chat "
    "(for --chat) over that mc_heldout.jsonl. Results go to <artifact>/eval/results-<time>.json "
    "(or --out DIR); with several artifacts a side-by-side table shows each one's value +- "
    "standard error and the deltas against the first. --config FILE instead takes the models "
    "and everything to score from FILE (models, labels, tasks, chat_tasks, demo_data, "
    "preference_data, answer_data, perplexity, out, ...: a pipeline eval stage's settings) and "
    "writes one results.json with a side-by-side table; it runs offline unless HF_HUB_OFFLINE=0."
)


def _limit(text: str) -> float | int:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--limit must be > 0, got {text}")
    return int(value) if value >= 1 else value


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate models with lm-eval tasks and perplexity",
        description="Run EleutherAI lm-eval tasks in process on one or more models (artifacts, "
        "quantized artifacts, HF directories) and/or their perplexity on held-out text.",
        epilog=EPILOG,
    )
    parser.add_argument("sources", nargs="*", metavar="ARTIFACT", help="models to evaluate")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="score the models and data that FILE names side by side (see below)",
    )
    parser.add_argument(
        "--tasks",
        action="append",
        default=[],
        metavar="T[,T...]",
        help="task names, comma-separated or repeated",
    )
    parser.add_argument(
        "--include-path",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="a directory of local task YAML files (repeatable)",
    )
    parser.add_argument(
        "--demo-data",
        type=Path,
        metavar="FILE",
        help="the demo's mc_heldout.jsonl: adds the tasks demo_mc and demo_mc_chat",
    )
    parser.add_argument("--limit", type=_limit, help="examples per task (a fraction if < 1)")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    add_runtime_arguments(parser)
    parser.add_argument(
        "--chat",
        action="store_true",
        help="render prompts with the model's chat template (lm-eval's apply_chat_template)",
    )
    parser.add_argument(
        "--max-length", type=int, help="longest input in tokens (default: the model's)"
    )
    parser.add_argument(
        "--log-samples", action="store_true", help="keep per-example responses in the JSON"
    )
    parser.add_argument(
        "--share-contexts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score a multiple-choice question's choices as one row, the question once "
        "(default); --no-share-contexts: each choice with its whole context",
    )
    parser.add_argument(
        "--seed", type=int, default=1234, help="seed for few-shot sampling and sampling"
    )
    parser.add_argument(
        "--out", type=Path, help="directory for results files (default: beside each artifact)"
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="never contact the Hugging Face hub (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1)",
    )
    parser.add_argument(
        "--perplexity",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a held-out UTF-8 text file to compute perplexity on (repeatable)",
    )
    parser.add_argument(
        "--seq-len", type=int, help="perplexity window (default: max length, at most 2048)"
    )
    parser.add_argument("--stride", type=int, help="perplexity window step (default: seq-len / 2)")
    parser.set_defaults(func=eval_main)


def eval_main(args: argparse.Namespace) -> int:
    from lmforge.generate.parallel import main_process_output

    with main_process_output():  # tensor parallel (`lmforge launch --nproc N eval`): rank 0
        return _eval(args)


def _eval(args: argparse.Namespace) -> int:
    if args.config is not None:
        return _eval_config(args)
    if not args.sources:
        raise ConfigError("give the models to evaluate (ARTIFACT...) or --config FILE")
    if args.offline:  # before datasets / huggingface_hub are imported: they read it then
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(
            "lmforge eval needs EleutherAI lm-eval: pip install 'lmforge[eval]'"
        ) from None
    tasks = [t.strip() for item in args.tasks for t in item.split(",") if t.strip()]
    if not tasks and not args.perplexity:
        raise ConfigError("nothing to evaluate: give --tasks and/or --perplexity FILE")
    from lmforge.api import detect_format, local_source

    # Hub ids become their cached copies (results are written beside a model).
    args.sources = [str(local_source(source)) for source in args.sources]
    for source in args.sources:  # a missing model before any task is loaded
        detect_format(source)
    with tempfile.TemporaryDirectory(prefix="lmforge-eval-tasks-") as demo_dir:
        include_path = list(args.include_path)
        if args.demo_data is not None:
            from lmforge.eval.tasks import write_demo_task

            include_path.append(write_demo_task(args.demo_data, demo_dir))
        if tasks:
            _run_tasks(args, tasks, include_path)
    if args.perplexity:
        _run_perplexity(args)
    return 0


def _run_tasks(args: argparse.Namespace, tasks: list[str], include_path: list[Path]) -> None:
    from lmforge.eval import format_comparison_table, format_results_table, run_eval

    evaluated = run_eval(
        args.sources,
        tasks,
        include_path=include_path,
        limit=args.limit,
        batch_size=args.batch_size,
        device=args.device,
        dtype=args.dtype,
        num_fewshot=args.num_fewshot,
        apply_chat_template=args.chat,
        max_length=args.max_length,
        log_samples=args.log_samples,
        seed=args.seed,
        out=args.out,
        share_contexts=args.share_contexts,
    )
    for result in evaluated:
        print(f"\n== {result.source}")
        print(format_results_table(result.results))
        print(f"results: {result.path}")
    if len(evaluated) > 1:
        print("\n== comparison")
        print(format_comparison_table(evaluated))


def _run_perplexity(args: argparse.Namespace) -> None:
    from lmforge.eval.harness import results_path, write_results
    from lmforge.eval.perplexity import perplexity
    from lmforge.generate import parallel

    print("\n== perplexity")
    for source in args.sources:
        report = perplexity(
            source,
            args.perplexity,
            seq_len=args.seq_len,
            stride=args.stride,
            batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
        )
        if not parallel.is_main():
            continue  # tensor parallel: rank 0 writes
        path = write_results(results_path(source, args.out, kind="perplexity"), report)
        print(
            f"{source}: perplexity {report['perplexity']:.4f} over {report['num_tokens']} tokens "
            f"(seq_len {report['seq_len']}, stride {report['stride']}) -> {path}"
        )


def _eval_config(args: argparse.Namespace) -> int:
    """`--config FILE`: the side-by-side evaluation a pipeline's eval stage runs."""
    import sys

    if args.sources or args.tasks or args.perplexity or args.include_path or args.demo_data:
        raise ConfigError(
            f"--config {args.config} names the models and what to score; do not also give "
            "ARTIFACT, --tasks, --perplexity, --include-path or --demo-data"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's progress bars, in a stage log
    from lmforge.config import load_config
    from lmforge.eval.stage import run_eval_stage
    from lmforge.pipeline.kinds import EvalStageSection

    cfg = load_config(EvalStageSection, args.config)
    problem = cfg.problem()
    if problem:
        raise ConfigError(f"{args.config}: {problem}")
    results = run_eval_stage(cfg)
    print(results["table"])
    print(f"results: {Path(cfg.out) / 'results.json'}", file=sys.stderr)
    return 0
