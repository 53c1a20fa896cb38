"""`lmforge download`: fetch a model repo from the Hugging Face hub into a directory.

A thin entry point: it reads the token from `--token` or `HF_TOKEN`, calls
`lmforge.hub.download_snapshot` and prints a one-line summary. Failures arrive as `HubError`,
which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lmforge.hub import DownloadResult, download_snapshot

EPILOG = """\
example (the seed's base model, without Meta's original consolidated.*.pth shards):
  lmforge download meta-llama/Meta-Llama-3-70B --out models/llama3-70b --exclude 'original/consolidated*'

Running the same command again resumes: complete files are skipped, partial ones continue.
Patterns are globs on repo paths ('*' also matches '/'); repeat --include/--exclude for several.
The token is sent to the hub only, never written to disk or printed; prefer HF_TOKEN to
--token, which other users can see in the process list. HF_ENDPOINT selects a mirror, and
HF_HUB_OFFLINE=1 makes the command fail at once instead of trying the network.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "download",
        help="download a model from the Hugging Face hub into a directory (resumable)",
        description="Download the files of a Hugging Face hub model repo into DIR, which any\n"
        "lmforge stage then takes as a model.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "repo_id", metavar="REPO_ID", help="hub repo id, e.g. meta-llama/Llama-3.2-1B"
    )
    parser.add_argument(
        "--out", required=True, type=Path, metavar="DIR", help="directory to download into"
    )
    parser.add_argument(
        "--include",
        action="append",
        metavar="GLOB",
        help="download only files matching GLOB (repeatable; default: all files)",
    )
    parser.add_argument(
        "--exclude", action="append", metavar="GLOB", help="skip files matching GLOB (repeatable)"
    )
    parser.add_argument(
        "--revision", metavar="REV", help="branch, tag or commit (default: the main branch)"
    )
    parser.add_argument(
        "--token",
        metavar="TOKEN",
        help="hub access token for gated or private repos (default: $HF_TOKEN)",
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("HF_TOKEN") or None
    result = download_snapshot(
        args.repo_id,
        args.out,
        include=args.include,
        exclude=args.exclude,
        revision=args.revision,
        token=token,
    )
    print(_summary(result))
    return 0


def _summary(result: DownloadResult) -> str:
    num_files = len(result.files)
    return (
        f"{result.repo_id}@{result.commit[:12]}: {num_files} file{'s' * (num_files != 1)}, "
        f"{_format_bytes(result.num_bytes)} ({result.num_bytes:,} bytes) in {result.out_dir}"
    )


def _format_bytes(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
