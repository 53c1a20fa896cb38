"""The one `lmforge` entry point.

Each subcommand lives in its own module under lmforge/commands/, which exposes
`register(subparsers)` to add its parser and sets `func` (a thin `main(args)`) as the parser
default; the modules import what their commands need when they run, so importing them all is
cheap. This file only collects them and
turns a `UserError` into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from lmforge.commands import (
    config,
    demo,
    download,
    generate,
    merge,
    model,
    plan,
    prepare,
    quantize,
    run,
    serve,
    tokenizer,
    train,
)
from lmforge.commands import eval as eval_command
from lmforge.errors import UserError, write_error
from lmforge.procs import Terminated, leave_now

# The modules that register subcommands, in the order `--help` lists them.
COMMAND_MODULES = [
    model,
    train,
    tokenizer,
    download,
    prepare,
    config,
    demo,
    merge,
    quantize,
    eval_command,
    generate,
    serve,
    run,
    plan,
]


class _VersionAction(argparse.Action):
    """`--version`: lmforge's version (+ git commit when run from a checkout) and torch's."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import torch

        from lmforge.artifact import code_version

        print(f"lmforge {code_version()} (torch {torch.__version__})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Take a Llama-family model through its whole life: prepare, pretrain, "
        "finetune, align, evaluate, quantize, generate, serve.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print lmforge's version")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Like `parse_args`, except that `key=value` overrides may come after options too
    (`lmforge sft --config sft.yaml lora.rank=16`): argparse stops collecting a positional
    list at the first option."""
    args, rest = parser.parse_known_args(argv)
    if rest and isinstance(getattr(args, "overrides", None), list):
        overrides = [item for item in rest if "=" in item and not item.startswith("-")]
        args.overrides += overrides
        rest = [item for item in rest if item not in overrides]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    # The process's entry point (console script, `python -m lmforge`, torchrun's workers) owns
    # its signals: preemption handlers, Ctrl-C as exit code 130. A call with argv (a test, a
    # notebook) leaves them to its caller, so Ctrl-C stops pytest, not just the test.
    args.owns_signals = argv is None
    try:
        result = args.func(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        code = err.exit_code
    except KeyboardInterrupt:
        if not args.owns_signals:
            raise
        print("interrupted", file=sys.stderr)
        code = 130
    except Terminated as stop:
        if not args.owns_signals:
            raise
        print("terminated (SIGTERM); the running stage was stopped first", file=sys.stderr)
        code = stop.exit_code
    except Exception as err:  # a full disk or a read-only directory is the user's to fix
        error = write_error(err)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        code = error.exit_code
    else:
        code = int(result or 0)
    if argv is None and ("TORCHELASTIC_RUN_ID" in os.environ or getattr(args, "exit_fast", False)):
        leave_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
