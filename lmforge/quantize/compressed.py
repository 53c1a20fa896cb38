"""Quantized artifacts in compressed-tensors' format (`lmforge quantize --format
compressed-tensors`): what llm-compressor writes, what vLLM serves with its mixed-precision
kernels (Marlin / Machete on NVIDIA GPUs, CPUWNA16 on CPUs, int4 only there), and what
transformers loads through the `compressed-tensors` package.

Weight-only, symmetric, round to nearest ("W4A16" / "W8A16", format "pack-quantized"): each
linear of a block becomes `weight_packed` (int32 [N, K * bits / 32]: compressed-tensors'
packing), `weight_scale` [N, K / group] (or [N, 1] per output row) in the model's dtype, and
`weight_shape` [2]; config.json carries the `quantization_config` that compressed-tensors' own
models describe. Scales and values are compressed-tensors' (`calculate_qparams`, `quantize`),
so the weights are exactly what its decompression, and vLLM's kernels, multiply. Embeddings,
norms and the output projection stay as they are (`ignore`).

`lmforge.load` reads such an artifact back by unpacking and dequantizing it into plain weights
(`lmforge.quantize.stored.dequantized_state`): lmforge's engine then runs it as bf16, so this is the format to hand to
vLLM, and `--format torchao` (the default) the one for `lmforge serve`.
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
BLOCK_LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
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
    `group_size` columns, or one scale an output row."""
    if scheme not in BITS:
        raise ConfigError(f"--format {FORMAT}: --scheme {scheme}; allowed: {', '.join(BITS)}")
    arguments = _library()[2]
    strategy = (
        {"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"}
    )
    return arguments(num_bits=BITS[scheme], type="int", symmetric=True, **strategy)


def compress_weight(weight: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """A linear's weight [N, K] -> its compressed-tensors tensors (suffixes of the linear's
    name): round to nearest with symmetric scales a group (or an output row)."""
    pack, _, _, _, _, _, quantize, calculate_qparams = _library()
    n, k = weight.shape
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


def compress_state(hf_state: dict[str, torch.Tensor], args) -> tuple[dict, list[str]]:
    """The HF state dict with every block linear compressed; returns it and their names."""
    out, linears = {}, []
    for name, tensor in hf_state.items():
        if BLOCK_LINEAR.search(name):
            prefix = name.removesuffix(".weight")
            linears.append(prefix)
            out.update({f"{prefix}.{k}": v for k, v in compress_weight(tensor, args).items()})
        else:
            out[name] = tensor
    return out, linears


def quantization_config(args) -> dict:
    """config.json's `quantization_config`, from compressed-tensors' models."""
    _, _, _, config, scheme, status, _, _ = _library()
    group = scheme(targets=["Linear"], weights=args)
    described = config(
        config_groups={"group_0": group},
        format="pack-quantized",
        ignore=["lm_head"],
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
    """Load `source`, compress its block linears and write the artifact; returns its path and
    the compressed linears' names."""
    from lmforge.api import generation_config, load

    args = quantization_args(scheme, group_size)
    artifact.check_output(out, inputs=[source], overwrite=overwrite)
    loaded = load(source, dtype=dtype)
    model_args = loaded.config
    hf_state = models.ours_state_dict_to_hf(loaded.model.state_dict(), model_args)
    stored_dtype = next(iter(hf_state.values())).dtype
    state, linears = compress_state(hf_state, args)
    config = models.args_to_hf_config(model_args, stored_dtype)
    config["quantization_config"] = quantization_config(args)
    lineage = {"scheme": scheme, "group_size": group_size, "format": FORMAT}
    with artifact.atomic_directory(Path(out), overwrite=overwrite) as staging:
        artifact.write_safetensors(
            state, staging, max_shard_bytes=artifact.parse_size(max_shard_size)
        )
        artifact.write_json(staging / artifact.CONFIG_NAME, config)
        generation = generation_config(model_args, loaded.tokenizer)
        artifact.write_json(staging / artifact.GENERATION_CONFIG_NAME, generation)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save(staging)
        record = artifact.lineage_record(
            stage="quantize", parent=source, config={"quantization": lineage}
        )
        record["hash"] = artifact.directory_hash(staging)
        artifact.write_json(staging / artifact.LINEAGE_NAME, record)
    return Path(out), linears
