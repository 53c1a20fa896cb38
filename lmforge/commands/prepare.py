"""`lmforge prepare`: tokenize text into memory-mapped token shards for pretraining.

A thin entry point: flags and `key=value` overrides (same names, `-` for `_`) become a
`PrepareSection` through `load_config` (defaults < --config file < command line), and
`lmforge.data.prepare.prepare` does the work.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lmforge.config import load_config
from lmforge.data.prepare import PrepareSection, prepare

EPILOG = """\
examples:
  lmforge prepare --input corpus/ --tokenizer models/llama3-8b --out data/corpus
  lmforge prepare --input 'wiki/*.jsonl' --text-field body --workers 8 --tokenizer tok --out data/wiki
  lmforge prepare --config prepare.toml workers=4

Every flag is also a config key (--text-field / text_field = "body"); flags and key=value
overrides win over the --config file. A malformed row stops with its file:line; pass
--skip-bad-rows to count and skip such rows (at most --max-bad-fraction of all rows).
"""

# Flags whose value is given as is; the others are declared one by one below.
_FLAGS = ("tokenizer", "out", "text_field", "dataset", "split", "dataset_config")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `prepare` to the CLI."""
    parser = subparsers.add_parser(
        "prepare",
        help="tokenize text / jsonl / parquet files or a hub dataset into token shards",
        description="Tokenize documents into memory-mapped token shards (each document "
        "followed by EOS) that `lmforge pretrain` reads.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="a .toml, .yaml or .yml config file")
    parser.add_argument(
        "--input", nargs="+", metavar="PATH", help="files, directories or glob patterns"
    )
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory or file")
    parser.add_argument("--out", metavar="DIR", help="output directory (must not exist)")
    parser.add_argument(
        "--format",
        choices=["auto", "text", "jsonl", "parquet"],
        help="input format (default auto: by file suffix)",
    )
    parser.add_argument("--text-field", metavar="NAME", help="jsonl field / column (text)")
    parser.add_argument(
        "--text-split",
        choices=["file", "paragraph"],
        help="text files: one document per file (default) or per blank-line-separated paragraph",
    )
    parser.add_argument("--workers", type=int, metavar="N", help="tokenizer processes (0: all)")
    parser.add_argument("--shard-tokens", type=int, metavar="N", help="tokens per shard file")
    parser.add_argument(
        "--skip-bad-rows",
        action="store_true",
        default=None,
        help="count and skip malformed rows instead of stopping",
    )
    parser.add_argument(
        "--max-bad-fraction", type=float, metavar="F", help="cap on skipped rows (0.01)"
    )
    parser.add_argument("--dataset", metavar="NAME", help="a Hugging Face dataset name")
    parser.add_argument("--split", metavar="SPLIT", help="dataset split (train)")
    parser.add_argument("--dataset-config", metavar="NAME", help="dataset configuration name")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. workers=4"
    )
    parser.set_defaults(func=main)


def _toml(value: Any) -> str:
    # JSON strings, numbers, booleans and lists of them are TOML values as well.
    return json.dumps(value)


def command_line_overrides(args: argparse.Namespace) -> list[str]:
    """The flags given on the command line as `key=value` items, then the explicit overrides.

    `--input a b workers=2` also works: trailing `key=value` items naming a config key are
    overrides, not inputs.
    """
    overrides = list(args.overrides)
    inputs = list(args.input or [])
    while inputs and inputs[-1].partition("=")[0] in PrepareSection.model_fields:
        overrides.insert(0, inputs.pop())
    items = []
    if inputs:
        items.append(f"input={_toml(inputs)}")
    for key in (
        *_FLAGS,
        "format",
        "text_split",
        "workers",
        "shard_tokens",
        "skip_bad_rows",
        "max_bad_fraction",
    ):
        value = getattr(args, key)
        if value is not None:
            items.append(f"{key}={_toml(value)}")
    return items + overrides


def main(args: argparse.Namespace) -> int:
    cfg = load_config(PrepareSection, args.config, command_line_overrides(args))
    result = prepare(cfg)
    skipped = (
        f", skipped {_count(result.num_bad_rows, 'malformed row')}" if result.num_bad_rows else ""
    )
    print(
        f"{result.out_dir}: {_count(result.num_tokens, 'token')} ({result.dtype}) from "
        f"{_count(result.num_documents, 'document')} in {_count(result.num_shards, 'shard')}"
        f"{skipped}"
    )
    return 0


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'s' * (number != 1)}"
