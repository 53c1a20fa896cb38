"""`lmforge pretrain`, `lmforge export` and `lmforge launch` (torchrun wrapper)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from pathlib import Path

from lmforge.commands.common import (
    add_config_file,
    add_overwrite_argument,
    apply_config_file,
    require_arguments,
)
from lmforge.errors import UserError

CONFIG_HELP = (
    "Settings come from the defaults, then --config FILE (TOML or YAML), then key=value "
    "overrides (e.g. train.steps=100 run_dir=runs/a). `lmforge config show pretrain` prints "
    "every key. Running the same command on the same run_dir resumes from its newest checkpoint."
)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML or YAML job config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


# The settings `export --config FILE` may give, as the command line spells them.
_EXPORT_ARGUMENTS = {"source": "RUN_DIR_OR_CHECKPOINT", "out": "OUT", "dtype": "--dtype"}


def register(subparsers) -> None:
    pretrain = subparsers.add_parser(
        "pretrain",
        help="pretrain or continue pretraining on prepared token shards",
        description="Next-token training on shards from `lmforge prepare`: from a preset "
        "(model.source=tiny) or continued from any HF / Meta / lmforge model. Runs in one "
        "process or under torchrun (see `lmforge launch`).",
        epilog=CONFIG_HELP,
    )
    add_config_arguments(pretrain)
    pretrain.set_defaults(func=pretrain_main)

    sft = subparsers.add_parser(
        "sft",
        help="instruction finetuning: full, LoRA or QLoRA",
        description="Finetune any model on instruction data (Alpaca, chat messages, ShareGPT or "
        "prompt/completion rows), full or with LoRA (lora.enabled=true) / QLoRA (also "
        "lora.quantize_base=nf4). Prompt tokens are masked out of the loss unless "
        "data.train_on_input=true. Writes an artifact (and the PEFT adapter under "
        "<artifact>/adapter/ for LoRA).",
        epilog=CONFIG_HELP.replace("pretrain", "sft"),
    )
    add_config_arguments(sft)
    sft.set_defaults(func=sft_main)

    dpo = subparsers.add_parser(
        "dpo",
        help="preference alignment with DPO (or robust DPO / IPO)",
        description="Align a model on (prompt, chosen, rejected) pairs with the DPO loss "
        "(dpo.beta, dpo.label_smoothing, dpo.loss_type=sigmoid|ipo). With LoRA the reference "
        "model is the policy with adapters switched off; with full finetuning a frozen copy.",
        epilog=CONFIG_HELP.replace("pretrain", "dpo"),
    )
    add_config_arguments(dpo)
    dpo.set_defaults(func=dpo_main)

    grpo = subparsers.add_parser(
        "grpo",
        help="online RL with verifiable rewards (GRPO, DAPO, Dr. GRPO and GSPO options)",
        description="Sample grpo.num_generations completions of each prompt with the engine, "
        "on the weights being trained, score them with [[grpo.rewards]] (exact_match, "
        "numeric_match, regex, length_penalty, or a python function of yours), and update the "
        "policy with the clipped group-relative loss (grpo.clip_low / clip_high, "
        "scale_rewards, loss_aggregation, importance_sampling, mu, beta). Full, LoRA or "
        "QLoRA; with `lmforge launch`, FSDP over several processes (each samples for its "
        "share of the prompts) and tensor parallelism (parallel.tp: the engine runs over the "
        "policy's shards).",
        epilog=CONFIG_HELP.replace("pretrain", "grpo"),
    )
    add_config_arguments(grpo)
    grpo.set_defaults(func=grpo_main)

    export = subparsers.add_parser(
        "export",
        help="turn a training checkpoint into an artifact",
        description="Write an artifact (HF layout + lmforge.json) from a run directory's newest "
        "committed checkpoint, or from one checkpoint directory.",
    )
    export.add_argument("source", nargs="?", type=Path, metavar="RUN_DIR_OR_CHECKPOINT")
    export.add_argument("out", nargs="?", type=Path, metavar="OUT")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    add_overwrite_argument(export)
    add_config_file(export, _EXPORT_ARGUMENTS, what="the source, OUT and --dtype")
    export.set_defaults(func=export_main)

    launch = subparsers.add_parser(
        "launch",
        help="run a training command under torchrun on this machine",
        description="Start N processes with torchrun (one per GPU, or gloo processes on CPU) "
        "running an lmforge command, e.g. `lmforge launch --nproc 2 pretrain --config job.toml`.",
    )
    launch.add_argument("--nproc", type=int, default=1, help="processes on this node")
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 (multi-node)")
    launch.add_argument(
        "command", nargs=argparse.REMAINDER, help="lmforge subcommand and its arguments"
    )
    launch.set_defaults(func=launch_main)


def pretrain_main(args: argparse.Namespace) -> int:
    from lmforge.config import load_config
    from lmforge.train.config import PretrainJob
    from lmforge.train.pretrain import pretrain

    job = load_config(PretrainJob, args.config, args.overrides)
    return run_training(pretrain, job, args)


def sft_main(args: argparse.Namespace) -> int:
    from lmforge.config import load_config
    from lmforge.train.config import SFTJob
    from lmforge.train.sft import sft

    return run_training(sft, load_config(SFTJob, args.config, args.overrides), args)


def dpo_main(args: argparse.Namespace) -> int:
    from lmforge.config import load_config
    from lmforge.train.config import DPOJob
    from lmforge.train.dpo import dpo

    return run_training(dpo, load_config(DPOJob, args.config, args.overrides), args)


def grpo_main(args: argparse.Namespace) -> int:
    from lmforge.config import load_config
    from lmforge.train.config import GRPOJob
    from lmforge.train.grpo import grpo

    return run_training(grpo, load_config(GRPOJob, args.config, args.overrides), args)


def run_training(fn, job, args: argparse.Namespace) -> int:
    """Run a training stage; a preemption exits with its documented code after saving. The
    planner decides parallel.reshard_after_forward = "auto" (`ReshardByPlan`), handed to the
    trainer from here: train does not import the planner. The preemption handlers are the
    process's when it is the CLI (`args.owns_signals`); a caller of `cli.main([...])` keeps its
    own (pytest stops on Ctrl-C and SIGTERM)."""
    from lmforge.plan.search import ReshardByPlan
    from lmforge.train.preempt import PreemptedError, PreemptionWatch

    watch = PreemptionWatch(job.train.preempt_signal)
    try:
        with watch if getattr(args, "owns_signals", False) else contextlib.nullcontext():
            out = fn(job, reshard=ReshardByPlan())
    except PreemptedError as err:
        print(str(err), file=sys.stderr)
        return err.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"artifact: {out}")
    return 0


def export_main(args: argparse.Namespace) -> int:
    from lmforge.pipeline.kinds import ExportStageSection
    from lmforge.train.export import export_checkpoint

    apply_config_file(args, ExportStageSection)
    require_arguments(args, {"source": "RUN_DIR_OR_CHECKPOINT", "out": "OUT"})
    out = export_checkpoint(args.source, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def torchrun_command(args: argparse.Namespace) -> list[str]:
    from lmforge.launch.base import torchrun_command as build

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError(
            "lmforge launch: name the subcommand to run, e.g. `pretrain --config job.toml`"
        )
    for flag, value, least in (("--nproc", args.nproc, 1), ("--nnodes", args.nnodes, 1)):
        if value < least:
            raise UserError(f"lmforge launch: {flag} {value} must be >= {least}")
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(
            f"lmforge launch: --node-rank {args.node_rank} must be in 0..{args.nnodes - 1}"
        )
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UserError("lmforge launch: --nnodes > 1 needs --rdzv-endpoint HOST:PORT")
    return build(
        command,
        nproc_per_node=args.nproc,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        node_rank=args.node_rank if args.nnodes > 1 else None,
    )


def launch_main(args: argparse.Namespace) -> int:
    from lmforge.launch.base import run_torchrun

    cmd = torchrun_command(args)
    print("+ " + shlex.join(cmd), file=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_torchrun(cmd)
