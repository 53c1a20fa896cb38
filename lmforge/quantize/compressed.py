"""Quantized artifacts in compressed-tensors' format (`lmforge quantize --format
compressed-tensors`): what llm-compressor writes, what vLLM serves with its mixed-precision
kernels (Marlin / Machete on NVIDIA GPUs, CPUWNA16 on CPUs, int4 only there), and what
transformers loads through the `compressed-tensors` package.

`--scheme fp8` is FP8-dynamic (W8A8, format "float-quantized"): each block linear's `weight`
in float8 e4m3 with `weight_scale` [N, 1] (amax / 448 a row), activations quantized a token at
run time (vLLM's fp8 kernels on sm_89+; lmforge loads it as torchao's `Float8Tensor`, whose
product is `torch._scaled_mm`).

Weight-only, symmetric, round to nearest ("W4A16" / "W8A16", format "pack-quantized"): each
linear of a block becomes `weight_packed` (int32 [N, K * bits / 32]: compressed-tensors'
packing), `weight_scale` [N, K / group] (or [N, 1] per output row) in the model's dtype, and
`weight_shape` [2]; config.json carries the `quantization_config` that compressed-tensors' own
models describe. Scales and values are compressed-tensors' (`calculate_qparams`, `quantize`),
so the weights are exactly what its decompression, and vLLM's kernels, multiply. A
Mixture-of-Experts' experts are quantized one expert's projection at a time, under the hub's
per-expert names (what llm-compressor writes and vLLM's MoE kernels read). Embeddings, norms,
a MoE's router and the output projection stay as they are (`ignore`). A safetensors source is read,
compressed and written one tensor at a time (the shard writer of `lmforge.quantize.quantize`),
so a 70B model needs the host memory of one weight and one shard, not of the model.

`lmforge.load` reads such an artifact back as the torchao int4 / int8 tensors lmforge's own
quantizer makes (`lmforge.quantize.stored.compressed_as_torchao`, the same ints and scales), so
`lmforge serve` runs it on its own int4 / int8 kernels too; `read_state_dict` dequantizes it
for whatever changes the weights (`stored.dequantized_state`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lmforge import artifact, models
from lmforge.errors import ConfigError, UserError
from lmforge.quantize.stored import quiet_torchao

FORMAT = "compressed-tensors"
QUANT_METHOD = "compressed-tensors"
# The linears of a block in Hugging Face's names (both families).
# a MoE's experts kept stacked in the file (gpt-oss), not one linear an expert (Qwen3-MoE)
STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up|down)_proj(_bias)?$")
BLOCK_LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp|mlp\.experts\.\d+)\.\w+_proj\.weight$")
BITS = {"int4-wo": 4, "int8-wo": 8}


def _library():
    quiet_torchao()  # compressed-tensors imports torchao when it is there: without its noise
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import (
            pack_to_int32,
            unpack_from_int32,
        )
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationConfig,
            QuantizationScheme,
            QuantizationStatus,
        )
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils.helpers import calculate_qparams
    except ImportError:
        raise UserError(
            "--format compressed-tensors needs the compressed-tensors package: pip install "
            "'lmforge[quant]'"
        ) from None
    return (pack_to_int32, unpack_from_int32, QuantizationArgs, QuantizationConfig,
            QuantizationScheme, QuantizationStatus, quantize, calculate_qparams)  # fmt: skip


def quantization_args(scheme: str, group_size: int | None):
    """compressed-tensors' description of `scheme`'s weights: symmetric int, in groups of
    `group_size` columns, or one scale an output row; fp8: float8 e4m3, a scale an output
    row."""
    arguments = _library()[2]
    if scheme == "fp8":
        if group_size is not None:
            raise ConfigError("--scheme fp8 has one scale an output row: no --group-size")
        return arguments(num_bits=8, type="float", symmetric=True, strategy="channel")
    if scheme not in BITS:
        allowed = ", ".join([*BITS, "fp8"])
        raise ConfigError(f"--format {FORMAT}: --scheme {scheme}; allowed: {allowed}")
    strategy = (
        {"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"}
    )
    return arguments(num_bits=BITS[scheme], type="int", symmetric=True, **strategy)


def compress_weight(weight: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """A linear's weight [N, K] -> its compressed-tensors tensors (suffixes of the linear's
    name): round to nearest with symmetric scales a group (or an output row)."""
    pack, _, _, _, _, _, quantize, calculate_qparams = _library()
    n, k = weight.shape
    if args.type == "float":  # fp8: the values themselves, a scale a row
        scale, zero = calculate_qparams(
            weight.float().amin(-1, True), weight.float().amax(-1, True), args
        )
        values = quantize(weight.float(), scale, zero, args, dtype=torch.float8_e4m3fn)
        return {"weight": values, "weight_scale": scale.to(weight.dtype)}
    group = args.group_size or k
    if k % group:
        raise ConfigError(f"--group-size {group} does not divide the linears' input size {k}")
    grouped = weight.float().reshape(n, k // group, group)
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    values = quantize(weight.float(), scale, zero, args, dtype=torch.int8)
    return {
        "weight_packed": pack(values, args.num_bits),
        "weight_scale": scale.to(weight.dtype),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }


def quantization_config(args) -> dict:
    """config.json's `quantization_config`, from compressed-tensors' models."""
    _, _, arguments, config, scheme, status, _, _ = _library()
    if args.type == "float":  # FP8-dynamic: activations a token at run time
        tokens = arguments(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        group = scheme(targets=["Linear"], weights=args, input_activations=tokens)
    else:
        group = scheme(targets=["Linear"], weights=args)
    described = config(
        config_groups={"group_0": group},
        format="float-quantized" if args.type == "float" else "pack-quantized",
        ignore=["lm_head", "re:.*mlp.gate$"],  # (a MoE's router stays as it is)
        quantization_status=status.COMPRESSED,
    )
    return described.model_dump(exclude_none=True)


def write_compressed(
    source: str | Path,
    out: str | Path,
    *,
    scheme: str,
    group_size: int | None,
    dtype: str | None = None,
    max_shard_size: str | int = artifact.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> tuple[Path, list[str]]:
    """Compress `source`'s block linears and write the artifact; returns its path and the
    compressed linears' names. A safetensors source is read, compressed and written one tensor
    at a time (the host holds one weight and the shard being written, any model size); any
    other (a preset, Meta or torchtitan checkpoints) is loaded whole."""
    from lmforge.api import detect_format, write_model_files
    from lmforge.quantize.quantize import FlatState, write_shards
    from lmforge.quantize.stored import is_compressed, is_quantized

    args = quantization_args(scheme, group_size)
    artifact.check_output(out, inputs=[source], overwrite=overwrite)
    streamed = detect_format(source) == "hf"
    if streamed and (is_quantized(Path(source)) or is_compressed(Path(source))):
        raise ConfigError(f"{source}: is already quantized; quantize the original")
    shapes, read, model_args, tokenizer = (_streamed if streamed else _whole)(source, dtype)
    stacked = [name for name in shapes if STACKED_EXPERTS.search(name)]
    if stacked:  # rather than quantize attention alone and leave the experts, unsaid
        raise ConfigError(
            f"{source}: its experts are stored stacked ({stacked[0]}), which lmforge's "
            "compressed-tensors writer does not quantize (it takes one linear an expert, the "
            "hub's Qwen3-MoE files, which `lmforge convert` writes; gpt-oss's experts not yet)"
        )
    sizes, produce, linears = _compressed_tensors(shapes, read, args)
    stored_dtype = next(t.dtype for t in shapes.values() if t.is_floating_point())
    config = models.args_to_hf_config(model_args, stored_dtype)
    config["quantization_config"] = quantization_config(args)
    lineage = {"scheme": scheme, "group_size": group_size, "format": FORMAT}
    with artifact.atomic_directory(Path(out), overwrite=overwrite) as staging:
        flat = FlatState(sizes, {}, {"format": "pt"}, [])
        write_shards(flat, produce, staging, artifact.parse_size(max_shard_size))
        record = artifact.lineage_record(
            stage="quantize", parent=source, config={"quantization": lineage}
        )
        record["quantization"] = lineage  # where the report and the planner read it
        write_model_files(staging, model_args, config, tokenizer, record)
    return Path(out), linears


def _streamed(source, dtype):
    """(HF names -> meta tensors, read(name), args, tokenizer) of a safetensors directory,
    each tensor read when asked (cast to `dtype`)."""
    from lmforge.api import load_tokenizer_for, parse_dtype, read_args
    from lmforge.quantize.streaming import SafetensorsSource

    path, dtype = Path(source), parse_dtype(dtype)
    tensors = SafetensorsSource(path)
    shapes = {n: t.to(dtype or t.dtype) for n, t in tensors.shapes.items()}
    model_args = read_args(path)

    def read(name: str) -> torch.Tensor:
        return tensors.read(name).to(dtype or shapes[name].dtype)

    return shapes, read, model_args, load_tokenizer_for(path, model_args)


def _whole(source, dtype):
    """The same for a source lmforge loads whole (its HF-named state dict in memory)."""
    from lmforge.api import load

    loaded = load(source, dtype=dtype)
    state = models.ours_state_dict_to_hf(loaded.model.state_dict(), loaded.config)
    shapes = {n: t.to("meta") for n, t in state.items()}
    return shapes, state.__getitem__, loaded.config, loaded.tokenizer


def _compressed_tensors(shapes: dict, read, args) -> tuple[dict[str, int], object, list[str]]:
    """The artifact's keys in order with their bytes, `produce(key)` making each (a block
    linear is compressed when its first key is asked, its three tensors handed out in turn),
    and the compressed linears' names."""
    sizes, linears, made = {}, [], {}
    for name, meta in shapes.items():
        if not BLOCK_LINEAR.search(name):
            sizes[name] = meta.numel() * meta.element_size()
            continue
        prefix, (n, k) = name.removesuffix(".weight"), meta.shape
        linears.append(prefix)
        if args.type == "float":
            sizes[f"{prefix}.weight"] = n * k  # float8: a byte a value
            sizes[f"{prefix}.weight_scale"] = n * meta.element_size()
            continue
        group = args.group_size or k
        if k % group:
            raise ConfigError(f"--group-size {group} does not divide {name}'s input size {k}")
        sizes[f"{prefix}.weight_packed"] = n * (k * args.num_bits // 32) * 4
        sizes[f"{prefix}.weight_scale"] = n * (k // group) * meta.element_size()
        sizes[f"{prefix}.weight_shape"] = 2 * 8
    # fp8 keeps a linear's `weight` key (its float8 values): made, not read
    made_keys = set(sizes) - set(shapes) | {f"{prefix}.weight" for prefix in linears}

    def produce(key: str) -> torch.Tensor:
        if key not in made_keys:
            return read(key)
        if key not in made:
            prefix = key.rsplit(".", 1)[0]
            tensors = compress_weight(read(f"{prefix}.weight"), args)
            made.update({f"{prefix}.{suffix}": t for suffix, t in tensors.items()})
        return made.pop(key)

    return sizes, produce, linears
