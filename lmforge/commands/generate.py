"""`lmforge generate ARTIFACT`: answer or continue prompts, and report the speed.

Text prompts of a model tuned to chat go through its chat template as user messages (what the
model was trained on), else they are continued as they are; `--raw` and `--chat` choose.

Prints each prompt's new text (streamed as it comes when there is one prompt), then the report:
time, tokens/s (decode alone and overall), achieved weight bandwidth and peak memory (under
`lmforge launch --nproc N`: the largest of the N processes, and each one's).
`--config FILE` gives the model, prompts and sampling settings instead (what a pipeline's
generate stage runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lmforge.commands.common import (
    add_config_file,
    add_runtime_arguments,
    apply_config_file,
    warm_up,
)
from lmforge.errors import ConfigError, DataError, ModelFormatError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text from an artifact and report tokens/s, bandwidth and memory",
        description="Generate from a model: prefill, then token-by-token decode with a static "
        "KV cache (torch.compile with CUDA graphs on GPU). Prompts are text or chat messages "
        "(rendered with the chat template; the answer stops at the end of turn). Text is sent "
        "as a user message through the chat template when the model was tuned to chat (an SFT "
        "or DPO stage in its lineage, or, with no lineage, a chat template of its own), and "
        "continued as it is (after BOS) otherwise or with --raw. Prints the texts and a speed "
        "report.",
        epilog="--prompts-file: plain text holds one prompt per non-empty line; a .jsonl file "
        'holds one JSON object per line, {"prompt": "..."} or {"messages": [{"role": ..., '
        '"content": ...}, ...]}. A model larger than one GPU: `lmforge launch --nproc N generate '
        "...` splits it over N GPUs (tensor parallel; rank 0 prints).",
    )
    parser.add_argument(
        "artifact",
        nargs="?",
        metavar="ARTIFACT",
        help="an artifact, HF Llama directory or hub id",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt",
        nargs="+",
        metavar="TEXT",
        help="text prompts (one each): answered through the chat template when the model was "
        "tuned to chat, else continued",
    )
    source.add_argument(
        "--chat",
        nargs="+",
        metavar="MESSAGE",
        help="user messages, each a one-turn conversation answered through the chat template",
    )
    source.add_argument("--prompts-file", type=Path, metavar="FILE", help="prompts, see below")
    parser.add_argument(
        "--raw",
        action="store_true",
        help="continue text prompts as they are, without the chat template of a chat-tuned model",
    )
    parser.add_argument("--system", metavar="TEXT", help="a system message for --chat")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P")
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="sample among tokens at least P times as likely as the likeliest (0: all)",
    )
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="no stop token or stop string ends a text before N new tokens (0)",
    )
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument(
        "--stop", nargs="+", default=[], metavar="STR", help="stop strings (cut from the text)"
    )
    add_runtime_arguments(
        parser, compile_help="torch.compile the decode step (default: on CUDA only)"
    )
    parser.add_argument(
        "--lora",
        type=Path,
        default=None,
        metavar="DIR",
        help="run with this PEFT LoRA adapter (lmforge's LoRA output or PEFT's) beside the "
        "artifact's weights, not merged into them",
    )
    parser.add_argument(
        "--max-batch", type=int, default=8, metavar="N", help="prompts decoded together (8)"
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="KV cache length (default: longest prompt + max-new-tokens)",
    )
    add_config_file(parser, _CONFIG_ARGUMENTS, what="ARTIFACT, the prompts and sampling")
    parser.set_defaults(func=main)


# The settings `--config FILE` may give, as the command line spells them.
_CONFIG_ARGUMENTS = {
    "artifact": "ARTIFACT",
    "prompt": "--prompt",
    "chat": "--chat",
    "raw": "--raw",
    "system": "--system",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
    "device": "--device",
    "dtype": "--dtype",
    "lora": "--lora",
}


def read_prompts_file(path: Path) -> list:
    """Text prompts (one per non-empty line) or, from .jsonl, {"prompt"} / {"messages"} rows."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    prompts: list = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON: {err.msg}") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            prompts.append(row["messages"])
        else:
            raise DataError(
                f'{path}:{number}: expected {{"prompt": "text"}} or {{"messages": [...]}}'
            )
    if not prompts:
        raise DataError(f"{path}: no prompts in the file")
    return prompts


def _label(prompt) -> str:
    text = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
    text = " ".join(str(text).split())
    return text if len(text) <= 70 else text[:67] + "..."


def _answers_in_chat(loaded) -> bool | None:
    """Whether text prompts go through the chat template by default: the model was tuned to
    chat (its lineage says so, or, with no lineage to ask, its tokenizer came with a template of
    its own rather than the one lmforge gives any Llama 3 vocabulary). None: it has no template,
    so there is nothing to choose."""
    from lmforge.artifact import chat_tuned
    from lmforge.data.tokenizer import LLAMA3_CHAT_TEMPLATE

    template = loaded.tokenizer.chat_template
    if template is None:
        return None
    tuned = chat_tuned(loaded.source)
    return tuned if tuned is not None else template != LLAMA3_CHAT_TEMPLATE


def main(args: argparse.Namespace) -> int:
    from lmforge.generate.parallel import main_process_output

    with main_process_output():  # tensor parallel: rank 0 prints
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from lmforge.generate import Generator, SamplingParams, parallel
    from lmforge.generate.sequence import encode_prompt
    from lmforge.modules.lora import read_peft_config
    from lmforge.pipeline.kinds import GenerateStageSection

    apply_config_file(args, GenerateStageSection)
    if args.artifact is None:
        raise ConfigError("the following arguments are required: ARTIFACT (or --config FILE)")
    sources = [args.prompt, args.chat, args.prompts_file]
    if sum(source is not None for source in sources) != 1:
        raise ConfigError("give one of --prompt, --chat or --prompts-file (or --config FILE)")
    if args.prompts_file is not None:
        prompts = read_prompts_file(args.prompts_file)
    elif args.chat is not None:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [[*system, {"role": "user", "content": message}] for message in args.chat]
    else:
        prompts = list(args.prompt)
    if args.system and args.chat is None:
        raise ConfigError("--system goes with --chat only")
    if args.raw and args.chat is not None:
        raise ConfigError("--raw and --chat: give one (--raw continues text, --chat answers it)")
    if args.max_batch < 1:
        raise ConfigError(f"--max-batch {args.max_batch} must be >= 1")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        stop=tuple(args.stop),
        min_tokens=args.min_tokens,
    )

    start = time.perf_counter()
    loaded = parallel.load_model(args.artifact, device=args.device, dtype=args.dtype)
    device = loaded.model.tok_embeddings.weight.device
    if loaded.tokenizer is None:
        raise ModelFormatError(
            f"{args.artifact}: has no tokenizer (tokenizer.json or tokenizer.model); "
            "generate needs one to read prompts and write text"
        )
    if not args.raw and any(isinstance(p, str) for p in prompts):
        chat = _answers_in_chat(loaded)
        if chat:
            print("applying the artifact's chat template (--raw for plain text)", file=sys.stderr)
            prompts = [
                [{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts
            ]
        elif chat is not None:
            print(
                "continuing the text as it is: the artifact was not tuned to chat (--chat "
                "MESSAGE to use its chat template)",
                file=sys.stderr,
            )
    model_args = loaded.config
    prompt_ids = [
        encode_prompt(p, loaded.tokenizer, vocab_size=model_args.vocab_size) for p in prompts
    ]
    longest = max(len(ids) for ids in prompt_ids)
    max_seq_len = args.max_seq_len or min(model_args.max_seq_len, longest + args.max_new_tokens)
    if longest >= max_seq_len:
        raise ConfigError(
            f"the longest prompt has {longest} tokens; --max-seq-len {max_seq_len} leaves no room "
            f"for new tokens (the model allows up to {model_args.max_seq_len})"
        )
    adapter_rank = 0
    if args.lora is not None:
        adapter_rank = read_peft_config(args.lora).rank  # (a bad directory: its error)
    generator = Generator(
        loaded.model,
        loaded.tokenizer,
        max_batch=min(args.max_batch, len(prompts)),
        max_seq_len=max_seq_len,
        device=device,
        compile=args.compile,
        max_adapters=int(args.lora is not None),
        max_adapter_rank=max(adapter_rank, 1),
    )
    adapter = None
    if args.lora is not None:
        adapter = "lora"
        generator.engine.load_adapter(adapter, args.lora)
    print(
        f"loaded {args.artifact} on {device} ({generator.dtype}) in "
        f"{time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    warm_up(generator)

    seed = parallel.shared_seed(args.seed)
    stream = generator.stream(prompt_ids, params, seed=seed, adapter=adapter)
    if len(prompts) == 1:  # print as it comes
        print(f"=== {_label(prompts[0])}")
        for events in stream:
            for event in events:
                print(event.text, end="", flush=True)
        print()
        results = stream.results
    else:
        results = stream.output().results
        for prompt, result in zip(prompts, results):
            print(f"=== {_label(prompt)}")
            print(result.text)
    for result in results:
        stop = f" at {result.stop!r}" if result.stop is not None else ""
        print(
            f"[{result.index + 1}] {len(result.prompt_ids)} prompt tokens, "
            f"{len(result.token_ids)} new, finish: {result.finish_reason}{stop}"
        )
    peaks = parallel.gather_from_all(stream.stats.peak_memory_bytes)
    if len(peaks) > 1:  # tensor parallel: every process's peak, and the largest
        stream.stats.process_peak_memory_bytes = peaks
        stream.stats.peak_memory_bytes = max(peaks)
    print()
    print(stream.stats.format())
    return 0
