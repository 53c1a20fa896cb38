"""`lmforge config show SCHEMA`: print a config resolved from defaults < file < key=value.

`SCHEMAS` maps each name to a function that imports and returns its Section class: listing them
costs nothing (the training jobs import torch), and each is plain code one can jump to.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable

from lmforge.config import ModelSection, Section, dump_config, load_config
from lmforge.errors import ConfigError


def _prepare() -> type[Section]:
    from lmforge.data.prepare import PrepareSection

    return PrepareSection


def _pretrain() -> type[Section]:
    from lmforge.train.config import PretrainJob

    return PretrainJob


def _sft() -> type[Section]:
    from lmforge.train.config import SFTJob

    return SFTJob


def _dpo() -> type[Section]:
    from lmforge.train.config import DPOJob

    return DPOJob


def _grpo() -> type[Section]:
    from lmforge.train.config import GRPOJob

    return GRPOJob


SCHEMAS: dict[str, Callable[[], type[Section]]] = {
    "model": lambda: ModelSection,
    "prepare": _prepare,
    "pretrain": _pretrain,
    "sft": _sft,
    "dpo": _dpo,
    "grpo": _grpo,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `config` and its actions to the CLI."""
    parser = subparsers.add_parser("config", help="show resolved configs")
    actions = parser.add_subparsers(dest="config_action", metavar="ACTION")
    parser.set_defaults(func=lambda args: _print_help(parser))

    show = actions.add_parser(
        "show",
        help="print a config resolved from defaults < --config file < key=value overrides",
        description="Print a config resolved from its defaults, then --config FILE, then "
        "key=value overrides (a value is read as TOML when it parses, else as text).",
    )
    show.add_argument("schema", metavar="SCHEMA", help=f"one of: {', '.join(sorted(SCHEMAS))}")
    show.add_argument("--config", metavar="FILE", help="a .toml, .yaml or .yml config file")
    show.add_argument("--format", choices=["toml", "yaml", "json"], default="toml")
    show.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. dtype=bfloat16")
    show.set_defaults(func=show_main)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def show_main(args: argparse.Namespace) -> int:
    """Resolve the named schema's config and print it to stdout."""
    if args.schema not in SCHEMAS:
        close = difflib.get_close_matches(args.schema, SCHEMAS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"unknown config schema {args.schema!r}: {hint}known: {', '.join(sorted(SCHEMAS))}"
        )
    cfg = load_config(SCHEMAS[args.schema](), args.config, args.overrides)
    sys.stdout.write(dump_config(cfg, args.format))
    return 0
