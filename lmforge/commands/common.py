"""Arguments several subcommands share (where a model runs and in which precision)."""

from __future__ import annotations

import argparse


def add_runtime_arguments(
    parser: argparse.ArgumentParser, *, compile_help: str | None = None
) -> None:
    """--device and --dtype (and --compile/--no-compile when `compile_help` is given)."""
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="compute dtype (default: as stored)",
    )
    if compile_help is not None:
        parser.add_argument(
            "--compile", action=argparse.BooleanOptionalAction, default=None, help=compile_help
        )
