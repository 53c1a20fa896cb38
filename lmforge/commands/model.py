"""`lmforge model info SOURCE` and `lmforge convert SOURCE OUT`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lmforge.commands.common import add_overwrite_argument

BYTES_PER_DTYPE = {"float32": 4, "bfloat16": 2, "int8": 1, "int4": 0.5}
MODEL_CONFIG_HELP = (
    "for a torchtitan checkpoint (which does not record the model): a preset, a torchtitan "
    "flavor (debugmodel, 1B, 3B, 8B, 70B, 405B), or a directory or file with config.json / params.json; "
    "a directory also supplies the tokenizer"
)


def register(subparsers) -> None:
    model = subparsers.add_parser("model", help="inspect a model", description="Inspect a model.")
    model_sub = model.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    info = model_sub.add_parser(
        "info",
        help="parameter counts, bytes per dtype and layer shapes",
        description="Print a model's shape without reading its weights: parameter counts with and "
        "without the input embedding, bytes per dtype, training FLOPs per token, layer shapes.",
        epilog="SOURCE is a preset (tiny, llama3.2-1b, llama3.2-3b, llama3.1-8b, llama3.1-70b, "
        "llama3.1-405b), a Hugging Face Llama directory or hub id (namespace/name, fetching only its "
        "config), an lmforge artifact, Meta's original "
        "download (params.json + consolidated.NN.pth), or a torchtitan DCP checkpoint (with "
        "--model-config).",
    )
    info.add_argument("source", metavar="SOURCE")
    info.add_argument("--seq-len", type=int, default=2048, help="for the FLOPs-per-token line")
    info.add_argument("--model-config", default=None, metavar="CONFIG", help=MODEL_CONFIG_HELP)
    info.set_defaults(func=info_main)

    convert = subparsers.add_parser(
        "convert",
        help="turn any supported model into an lmforge artifact",
        description="Read a HF directory, a Meta original download, an artifact, a preset or a "
        "torchtitan DCP checkpoint (a step-N directory or its dump folder) and write an artifact "
        "(HF layout + lmforge.json) that transformers and vLLM load as it is.",
    )
    convert.add_argument("source", metavar="SOURCE")
    convert.add_argument("out", metavar="OUT", type=Path)
    convert.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="cast the weights (default: keep the stored dtype)",
    )
    convert.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard, e.g. 5GB, 500MB (default 5GB)",
    )
    convert.add_argument("--model-config", default=None, metavar="CONFIG", help=MODEL_CONFIG_HELP)
    add_overwrite_argument(convert)
    convert.set_defaults(func=convert_main)


def _human(count: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(count) >= scale:
            return f"{count / scale:.2f}{suffix}{unit}"
    return f"{count:.0f}{unit}"


def info_main(args: argparse.Namespace) -> int:
    import torch

    from lmforge import models
    from lmforge.api import detect_format, read_args

    model_args = read_args(args.source, model_config=args.model_config)
    with torch.device("meta"):
        model = models.new_model(model_args)
    total = model_args.num_params()
    without_embedding = model_args.num_params(include_embedding=False)
    print(f"source:      {args.source} ({detect_format(args.source)})")
    print(
        f"shape:       dim {model_args.dim}, layers {model_args.num_layers}, heads "
        f"{model_args.num_heads} (kv {model_args.num_kv_heads}, head_dim {model_args.head_dim}), "
        f"ffn {model_args.ffn_dim}, vocab {model_args.vocab_size}"
    )
    scaling = model_args.rope_scaling
    rope = f"theta {model_args.rope_theta:g}" + (
        f", llama3 scaling x{scaling.factor:g} (from {scaling.original_max_seq_len})"
        if scaling
        else ""
    )
    print(f"rope:        {rope}; max_seq_len {model_args.max_seq_len}")
    print(f"embeddings:  {'tied' if model_args.tie_embeddings else 'untied'}")
    print(
        f"parameters:  {total:,} ({_human(total)}); without input embedding {without_embedding:,}"
    )
    sizes = ", ".join(
        f"{name} {_human(total * size, 'B')}" for name, size in BYTES_PER_DTYPE.items()
    )
    print(f"bytes:       {sizes}")
    active = model_args.num_params(active=True)
    if active != total:  # a Mixture-of-Experts: what one token runs through
        print(f"active:      {active:,} ({_human(active)}) a token: attention, chosen experts")
        sizes = ", ".join(
            f"{name} {_human(active * size, 'B')}" for name, size in BYTES_PER_DTYPE.items()
        )
        print(f"active bytes: {sizes}")
    flops = model_args.flops_per_token(args.seq_len)
    print(f"train FLOPs: {_human(flops)} per token at seq_len {args.seq_len}")
    print(f"layer shapes (block 0 of {model_args.num_layers} shown):")
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue
        print(f"  {name:42s} {list(param.shape)}")
    return 0


def convert_main(args: argparse.Namespace) -> int:
    import lmforge
    from lmforge.artifact import check_output

    start = time.perf_counter()
    check_output(args.out, inputs=[args.source], overwrite=args.overwrite)  # before loading
    loaded = lmforge.load(args.source, dtype=args.dtype, model_config=args.model_config)
    out = lmforge.save(
        loaded,
        args.out,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(
        f"wrote {out} ({_human(size, 'B')}, {len(files)} files) in {time.perf_counter() - start:.1f}s"
    )
    return 0
