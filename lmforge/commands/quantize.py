"""`lmforge quantize ARTIFACT OUT --scheme int8-wo|int4-wo [--group-size N]` (torchao), or
`lmforge quantize --config FILE` (what a pipeline's quantize stage runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmforge.commands.common import (
    add_config_file,
    add_overwrite_argument,
    apply_config_file,
    require_arguments,
)
from lmforge.quantize.schemes import INT4_GROUP_SIZES, SCHEMES


def register(subparsers) -> None:
    quantize = subparsers.add_parser(
        "quantize",
        help="weight-only int8 / int4 quantization (torchao)",
        description="Quantize the linears of every transformer block with torchao and write a "
        "quantized artifact that lmforge load / eval / generate / serve read as they read any "
        "other, and that transformers (TorchAoConfig) loads as it is. Embeddings stay in their "
        "dtype; so does the output projection unless --quantize-output. The scheme, group size "
        "and modules are recorded in lmforge.json. A safetensors source is read, quantized and "
        "written one tensor at a time (memory: one weight plus one output shard), any size.",
        epilog="Kernels: cpu runs int8-wo and int4-wo; cuda runs int8-wo, and int4-wo on compute "
        "capability 8.0+ (tinygemm, group size 32/64/128/256; such an artifact loads on cuda "
        "only, in transformers too).",
    )
    quantize.add_argument(
        "source", nargs="?", metavar="ARTIFACT", help="artifact, HF directory or preset"
    )
    quantize.add_argument("out", nargs="?", metavar="OUT", type=Path)
    quantize.add_argument(
        "--scheme",
        choices=SCHEMES,
        help="required: int8-wo / int4-wo (weight-only), or fp8 (W8A8: float8 e4m3 weights with "
        "a scale a row and activations quantized a token at run time, written as "
        "compressed-tensors' FP8-dynamic, which vLLM serves and transformers loads; its "
        "products are float8 tensor-core products on GPUs of compute capability 8.9+)",
    )
    quantize.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="values sharing one scale; must divide the linears' input sizes "
        f"(default: {INT4_GROUP_SIZES[0]} for int4-wo, or where it does not divide them the "
        f"largest of {', '.join(map(str, INT4_GROUP_SIZES[1:]))} that does, said in a note; one "
        "scale per output row for int8-wo; Llama 3.1 8B on an "
        "H200 decodes int4 9%% faster in groups of 256 than of 128; docs/benchmarks.md; "
        "--format compressed-tensors: 128, or the largest of 64, 32 dividing every size, a "
        "MoE's experts' width included)",
    )
    quantize.add_argument(
        "--quantize-output",
        action="store_true",
        help="quantize the output projection too (untied from the embeddings if tied): faster "
        "batch-1 decode, at the cost of the head's precision and, when tied, a second copy "
        "(Llama 3.2 1B on an H200: int8 1.38x bf16 instead of 1.29x; docs/benchmarks.md)",
    )
    quantize.add_argument(
        "--pack-int4",
        action="store_true",
        help="int4-wo on the cpu: store two values per byte (file ~1/4 of bf16 instead of ~1/2); "
        "only lmforge loads such an artifact, transformers and vLLM refuse it",
    )
    quantize.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard written (default 5GB); also bounds the memory used",
    )
    quantize.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="load the whole model before quantizing it (the artifact is the same; streaming "
        "holds one weight at a time)",
    )
    quantize.add_argument(
        "--device",
        default=None,
        help="where to quantize (and which kernels the artifact targets); default cuda if "
        "available, else cpu",
    )
    quantize.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="cast the model before quantizing (default: the stored dtype)",
    )
    quantize.add_argument(
        "--format",
        choices=["torchao", "compressed-tensors"],
        default=None,
        help="torchao (default; compressed-tensors with --method gptq): what lmforge serve runs "
        "fastest; compressed-tensors: W4A16 / "
        "W8A16 as llm-compressor writes it, which vLLM serves with its Marlin/Machete kernels "
        "(lmforge serve --engine vllm) and transformers loads through compressed-tensors "
        "(int4 group size 128 by default; lmforge serves it on its own int4 / int8 kernels)",
    )
    calibrated = quantize.add_argument_group(
        "calibrated (GPTQ through llm-compressor, in its own environment: make calibrate)"
    )
    calibrated.add_argument(
        "--method",
        choices=["rtn", "gptq"],
        default="rtn",
        help="rtn (default): each weight rounded to its nearest value; gptq: columns quantized "
        "in turn, the rest corrected for the error on calibration samples (less accuracy "
        "lost at int4); writes compressed-tensors",
    )
    calibrated.add_argument(
        "--calibration",
        type=Path,
        metavar="DATA",
        help="gptq's samples: a `lmforge prepare` directory (token windows) or JSONL rows with "
        "text, prompt (+ response) or messages",
    )
    calibrated.add_argument(
        "--calibration-samples", type=int, default=128, help="sequences (default 128)"
    )
    calibrated.add_argument(
        "--calibration-seq-len", type=int, default=512, help="tokens a sequence (default 512)"
    )
    calibrated.add_argument(
        "--calibrate-python",
        metavar="PYTHON",
        help="the Python of an environment with llm-compressor (default "
        "$LMFORGE_CALIBRATE_PYTHON, else the checkout's .venv-calibrate)",
    )
    add_overwrite_argument(quantize)
    add_config_file(quantize, _ARGUMENTS, what="ARTIFACT, OUT and the options")
    quantize.set_defaults(func=quantize_main)


# The settings --config FILE may give, as the command line spells them.
_ARGUMENTS = {
    "source": "ARTIFACT",
    "out": "OUT",
    "scheme": "--scheme",
    "group_size": "--group-size",
    "quantize_output": "--quantize-output",
    "device": "--device",
    "dtype": "--dtype",
    "format": "--format",
    "method": "--method",
    "calibration": "--calibration",
    "calibration_samples": "--calibration-samples",
    "calibration_seq_len": "--calibration-seq-len",
}


def _write_compressed(args: argparse.Namespace) -> int:
    import time

    from lmforge.api import local_source
    from lmforge.errors import ConfigError
    from lmforge.quantize.compressed import write_compressed

    for flag, value in (
        ("--pack-int4", args.pack_int4),
        ("--quantize-output", args.quantize_output),
        ("--format torchao", args.format == "torchao"),
    ):
        if value:
            raise ConfigError(
                f"{flag} is a torchao option: not with --format compressed-tensors"
                + (" (where --scheme fp8 is written)" if args.scheme == "fp8" else "")
            )
    source = local_source(args.source)
    group = _compressed_group_size(args, source)
    start = time.perf_counter()
    out, linears = write_compressed(
        source, args.out, scheme=args.scheme, group_size=group, dtype=args.dtype,
        max_shard_size=args.max_shard_size, overwrite=args.overwrite,
    )  # fmt: skip
    size = sum(p.stat().st_size for p in Path(out).glob("*.safetensors"))
    name = {"int4-wo": "W4A16", "int8-wo": "W8A16", "fp8": "FP8-dynamic (W8A8)"}[args.scheme]
    scales = f"group size {group}" if group else "a scale an output row"
    if args.scheme == "fp8":
        scales += ", activations a token at run time"
    print(
        f"quantized {len(linears)} linears of {args.source} to compressed-tensors {name} "
        f"({scales}) in "
        f"{time.perf_counter() - start:.1f}s -> {out} ({_size(size)} of weights)\n"
        f"serve it with vLLM: lmforge serve {out} --engine vllm"
    )
    return 0


def _compressed_group_size(args: argparse.Namespace, source) -> int | None:
    """--group-size; for int4 without one, 128 (compressed-tensors' and vLLM's usual) or the
    largest smaller of INT4_GROUP_SIZES that divides every quantized input size, a MoE's
    experts' width included (the writer names a size none divides)."""
    if args.group_size or args.scheme != "int4-wo":
        return args.group_size
    from lmforge.api import read_args

    model = read_args(source)
    sparse = len(getattr(model, "moe_layers", ()))
    sizes = {model.dim, model.num_heads * model.head_dim}
    sizes |= {model.moe_ffn_dim} if sparse else set()
    sizes |= {model.ffn_dim} if sparse < model.num_layers else set()  # dense MLPs
    fits = [g for g in INT4_GROUP_SIZES if g <= 128 and all(size % g == 0 for size in sizes)]
    return fits[0] if fits else 128


def _write_calibrated(args: argparse.Namespace) -> int:
    import time

    from lmforge.api import local_source
    from lmforge.errors import ConfigError
    from lmforge.quantize.calibrated import write_calibrated

    if args.calibration is None:
        raise ConfigError("--method gptq needs --calibration DATA (samples to calibrate on)")
    if args.scheme == "fp8":
        raise ConfigError("--method gptq: --scheme int4-wo or int8-wo (fp8 is round to nearest)")
    for flag, value in (
        ("--pack-int4", args.pack_int4),
        ("--quantize-output", args.quantize_output),
        ("--format torchao", args.format == "torchao"),
    ):
        if value:
            raise ConfigError(f"{flag} is not for --method gptq (it writes compressed-tensors)")
    for flag, value in (
        ("--calibration-samples", args.calibration_samples),
        ("--calibration-seq-len", args.calibration_seq_len),
    ):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be at least 1")
    group = _compressed_group_size(args, local_source(args.source))
    start = time.perf_counter()
    out, samples = write_calibrated(
        args.source, args.out, scheme=args.scheme, group_size=group, data=args.calibration,
        samples=args.calibration_samples, seq_len=args.calibration_seq_len,
        python=args.calibrate_python, overwrite=args.overwrite,
    )  # fmt: skip
    name = {"int4-wo": "W4A16", "int8-wo": "W8A16"}[args.scheme]
    print(
        f"quantized {args.source} with GPTQ (llm-compressor, {samples} samples of "
        f"{args.calibration}) to compressed-tensors {name} "
        f"({f'group size {group}' if group else 'per output row'}) in "
        f"{time.perf_counter() - start:.1f}s -> {out}"
    )
    return 0


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    for scale, suffix in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {suffix}"
    return f"{num_bytes} B"


def _ratio(new: int | None, old: int | None) -> str:
    return f"{new / old:.3f}x" if new and old else "-"


def quantize_main(args: argparse.Namespace) -> int:
    import time

    from lmforge.pipeline.kinds import QuantizeStageSection

    apply_config_file(args, QuantizeStageSection)
    require_arguments(args, {"source": "ARTIFACT", "out": "OUT", "scheme": "--scheme"})

    import torch

    from lmforge.api import local_source
    from lmforge.quantize import quantize_artifact

    if args.method == "gptq":
        return _write_calibrated(args)
    if args.format == "compressed-tensors" or args.scheme == "fp8":
        return _write_compressed(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    result = quantize_artifact(
        local_source(args.source),  # a hub id: its cached copy, downloaded on first use
        args.out,
        scheme=args.scheme,
        group_size=args.group_size,
        quantize_output=args.quantize_output,
        pack_int4=args.pack_int4,
        device=device,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        stream=args.stream,
        overwrite=args.overwrite,
    )
    spec, old, new = result.spec, result.original, result.quantized
    group = f"group size {spec.group_size}" if spec.group_size else "per output row"
    how = "tensor by tensor" if result.streamed else "whole model"
    print(
        f"quantized {len(result.modules)} linears of {args.source} with {spec.scheme} ({group}) "
        f"on {device}, {how}, in {time.perf_counter() - start:.1f}s -> {result.path}"
    )
    for note in result.notes:
        print(f"note: {note}")
    for warning in result.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    print(f"{'':16s} {'original':>12s} {'quantized':>12s} {'ratio':>8s}")
    rows = [
        ("on disk", old.disk_bytes, new.disk_bytes),
        ("in memory", old.memory_bytes, new.memory_bytes),
        ("linear weights", old.linear_bytes, new.linear_bytes),
        ("  (as bf16)", new.linear_bf16_bytes, new.linear_bytes),
    ]
    for label, before, after in rows:
        print(f"{label:16s} {_size(before):>12s} {_size(after):>12s} {_ratio(after, before):>8s}")
    return 0
