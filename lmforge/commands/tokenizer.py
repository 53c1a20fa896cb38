"""`lmforge tokenizer`: train a byte-level BPE on text files, and look inside a tokenizer.

`train` writes a directory that `load_tokenizer` and transformers both read; `encode` and `info`
are for debugging what a model directory's tokenizer does with a given text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lmforge.commands.common import add_config_file, apply_config_file, require_arguments
from lmforge.data.tokenizer import load_tokenizer, train_bpe

SOURCE_HELP = (
    "a tokenizer: a directory with tokenizer.json (+ tokenizer_config.json) or with "
    "original/tokenizer.model, or the tokenizer.json / tokenizer.model file itself"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenizer` with its `train`, `encode` and `info` actions."""
    parser = subparsers.add_parser(
        "tokenizer",
        help="train a BPE tokenizer, or encode text to see its token ids",
        description="Train a byte-level BPE tokenizer with Llama 3's split rules and special "
        "tokens, or inspect an existing tokenizer (Hugging Face tokenizer.json or Llama 3's "
        "tiktoken tokenizer.model).",
    )
    actions = parser.add_subparsers(dest="tokenizer_action", metavar="ACTION")

    def print_help(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=print_help)

    train = actions.add_parser(
        "train",
        help="train a byte-level BPE tokenizer on UTF-8 text files",
        description="Train a byte-level BPE (Llama 3 pre-tokenization regex, special tokens "
        "<|begin_of_text|> <|end_of_text|> <|start_header_id|> <|end_header_id|> <|eot_id|> "
        "<|finetune_right_pad_id|> at the last ids, Llama 3 chat template) and save it as "
        "tokenizer.json + tokenizer_config.json, loadable by transformers.AutoTokenizer.",
    )
    train.add_argument(
        "--input",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="UTF-8 text files to learn the merges from (required)",
    )
    train.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="total number of ids, special tokens included (at least 262; required)",
    )
    train.add_argument(
        "--out", type=Path, metavar="DIR", help="directory to write the files to (required)"
    )
    train.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        metavar="N",
        help="merge only pairs seen at least N times (default: %(default)s)",
    )
    add_config_file(
        train,
        {
            "input": "--input",
            "vocab_size": "--vocab-size",
            "min_frequency": "--min-frequency",
            "out": "--out",
        },
        what="the options",
    )
    train.set_defaults(func=main_train)

    encode = actions.add_parser(
        "encode",
        help="print the token ids of a text",
        description="Print the token ids of TEXT as a JSON list. Special-token text in TEXT "
        "stays text unless --chat is given.",
    )
    encode.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    encode.add_argument("text", metavar="TEXT", help="the text to encode; '-' reads stdin")
    encode.add_argument("--bos", action="store_true", help="prepend the BOS token")
    encode.add_argument("--eos", action="store_true", help="append the EOS token")
    encode.add_argument(
        "--chat",
        action="store_true",
        help="encode TEXT as one user message rendered with the chat template, "
        "followed by the assistant header",
    )
    encode.add_argument(
        "--pieces", action="store_true", help="also print each id with the text it stands for"
    )
    encode.set_defaults(func=main_encode)

    info = actions.add_parser(
        "info",
        help="print vocabulary size, special ids and fingerprint of a tokenizer",
        description="Print what lmforge reads from a tokenizer: backend, vocabulary size, "
        "BOS/EOS/EOT/pad ids, stop ids, chat template and fingerprint.",
    )
    info.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    info.set_defaults(func=main_info)


def main_train(args: argparse.Namespace) -> int:
    from lmforge.pipeline.kinds import TokenizerStageSection

    apply_config_file(args, TokenizerStageSection)
    require_arguments(args, {"input": "--input", "vocab_size": "--vocab-size", "out": "--out"})
    start = time.perf_counter()
    tokenizer = train_bpe(
        args.input, vocab_size=args.vocab_size, out_dir=args.out, min_frequency=args.min_frequency
    )
    seconds = time.perf_counter() - start
    num_special = len(tokenizer.special_tokens)
    print(
        f"vocab size: {tokenizer.vocab_size} "
        f"({tokenizer.vocab_size - num_special} learned + {num_special} special tokens)"
    )
    print(f"merges: {tokenizer.num_merges}")
    print(f"time: {seconds:.1f} s")
    print(f"saved to: {args.out}")
    return 0


def main_encode(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.source)
    text = sys.stdin.read() if args.text == "-" else args.text
    if args.chat:
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    else:
        ids = tokenizer.encode(text, bos=args.bos, eos=args.eos)
    print(json.dumps(ids))
    if args.pieces:
        for token_id in ids:
            print(f"{token_id:>8}  {tokenizer.decode([token_id])!r}")
    print(f"{len(ids)} tokens", file=sys.stderr)
    return 0


def main_info(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.source)
    print(f"source: {tokenizer.source}")
    print(f"backend: {tokenizer.backend}")
    print(f"vocab size: {tokenizer.vocab_size} ({len(tokenizer.special_tokens)} special tokens)")
    for name in ("bos_id", "eos_id", "eot_id", "pad_id"):
        print(f"{name}: {getattr(tokenizer, name)}")
    print(f"stop ids: {sorted(tokenizer.stop_ids)}")
    print(f"chat template: {'yes' if tokenizer.chat_template else 'no'}")
    print(f"fingerprint: {tokenizer.fingerprint()}")
    return 0
