"""The quantize stage: an artifact (or HF directory, preset, Meta or torchtitan checkpoint) in,
a quantized artifact out. A safetensors source is streamed tensor by tensor
(`lmforge.quantize.streaming`); any other is loaded whole, quantized and saved
(`lmforge.quantize.quantize`). Both write the same artifact.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from lmforge import artifact
from lmforge.errors import ConfigError
from lmforge.quantize.quantize import (
    PACKED_WARNING,
    QuantizeResult,
    QuantSpec,
    SizeReport,
    check_group_size,
    check_packing,
    check_scheme,
    finish_result,
    quantize_model,
    quantize_notes,
    save_quantized,
    weight_file_bytes,
)
from lmforge.quantize.stored import PACKED_CONFIG_TYPE
from lmforge.quantize.streaming import quantize_streaming
from lmforge.sizes import module_bytes


def quantize_artifact(
    source: str | Path,
    out: str | Path,
    *,
    scheme: str,
    group_size: int | None = None,
    quantize_output: bool = False,
    pack_int4: bool = False,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = artifact.DEFAULT_MAX_SHARD_BYTES,
    stream: bool = True,
    overwrite: bool = False,
) -> QuantizeResult:
    """Quantize `source` on `device` and write the quantized artifact to `out`.

    A safetensors source (artifact or HF directory) is streamed one tensor at a time unless
    `stream=False`; other sources are loaded whole. `dtype` casts the weights first (default:
    keep the stored dtype; int4 on CUDA uses bf16). `out` may not be or hold `source`; an
    artifact there is replaced only with `overwrite`.
    """
    from lmforge.api import detect_format

    spec = QuantSpec(scheme, group_size, quantize_output, pack_int4)
    check_scheme(scheme, device)
    check_packing(spec, device)
    artifact.parse_size(max_shard_size)  # a bad size fails before any work
    artifact.check_output(out, inputs=[source], overwrite=overwrite)
    kind = detect_format(source)
    _refuse_experts(source)
    if stream and kind == "hf":
        result = quantize_streaming(
            Path(source),
            Path(out),
            spec,
            device=device,
            dtype=dtype,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
        )
    else:
        result = _quantize_whole(source, out, spec, device, dtype, max_shard_size, overwrite)
        if kind != "hf":
            result.notes.append(
                f"loaded the whole model: only safetensors directories are streamed, not a "
                f"{kind} source"
            )
    if pack_int4:
        result.warnings.append(PACKED_WARNING.format(type=PACKED_CONFIG_TYPE))
    return result


def _refuse_experts(source: str | Path) -> None:
    """torchao's weight-only layouts cover linears, not a Mixture-of-Experts' stacked experts:
    rather than leave them in bf16 unsaid, send the user to the formats that quantize them."""
    from lmforge.api import read_args

    if getattr(read_args(source), "num_experts", 0):
        raise ConfigError(
            f"{source}: a Mixture-of-Experts model; --format torchao (the default for int8-wo / "
            "int4-wo) does not quantize its experts: use --format compressed-tensors (W8A16 / "
            "W4A16, every expert, as vLLM's MoE kernels read them) or --scheme fp8"
        )


def _quantize_whole(
    source, out, spec: QuantSpec, device, dtype, max_shard_size, overwrite
) -> QuantizeResult:
    """Load the whole model on `device`, quantize it there and save it."""
    from lmforge.api import detect_format, load

    loaded = load(source, device=device, dtype=dtype)
    if loaded.lineage.get("quantization"):
        scheme_done = loaded.lineage["quantization"]["scheme"]
        raise ConfigError(f"{source}: is already quantized ({scheme_done}); quantize the original")
    group_size_given = spec.group_size is not None
    spec = replace(spec, group_size=check_group_size(spec, loaded.config, device))
    source_dir = Path(source) if detect_format(source) == "hf" else None  # has safetensors
    original = SizeReport(
        disk_bytes=weight_file_bytes(source_dir) if source_dir else None,
        memory_bytes=module_bytes(loaded.model),
    )
    start_dtype = next(loaded.model.parameters()).dtype
    modules = quantize_model(loaded.model, spec)
    notes = quantize_notes(
        loaded.config, loaded.model, spec, device, start_dtype, group_size_given=group_size_given
    )
    loaded.config = loaded.model.args
    path = save_quantized(
        loaded, out, spec=spec, modules=modules, max_shard_size=max_shard_size, overwrite=overwrite
    )
    return finish_result(path, spec, modules, original, loaded.model, source_dir, notes)
