"""Streaming quantization: a safetensors model quantized one tensor at a time, for any size.

The whole-model path (`quantize._quantize_whole`) loads every weight, quantizes the model and
saves it. Here the same code runs first on the meta device (no memory): the model built from the
safetensors headers is quantized there, which gives every stored key, its size, the shards and
torchao's metadata of the artifact. Then the tensors are made for real in that order: read one
from the source shards, cast, quantize it with the same torchao config (on the CPU or the GPU),
flatten it, and hand it to the shard writer, which holds one shard at a time. The host holds one
weight (bf16 and quantized) plus the shard being written; the GPU one weight. The artifact's
tensors and metadata equal the whole-model path's (tests/test_quantize.py), and each tensor made
for real is checked against the plan.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from lmforge import artifact, models
from lmforge.errors import ConfigError, ModelFormatError
from lmforge.models import ModelArgs
from lmforge.quantize.quantize import (
    FlatState,
    QuantizeResult,
    QuantSpec,
    SizeReport,
    casts_to_bfloat16,
    check_group_size,
    finish_result,
    flatten_state,
    flatten_tensor,
    hf_state,
    quantize_model,
    quantize_notes,
    quantize_weight,
    torchao_config,
    weight_file_bytes,
    write_quantized,
)
from lmforge.quantize.stored import is_quantized, require_torchao
from lmforge.sizes import module_bytes

# safetensors' dtype names of the floating-point weights a model may be stored in
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class SafetensorsSource:
    """The tensors of a (possibly sharded) safetensors model directory, read one at a time;
    `shapes` holds each key's shape and dtype as a meta tensor (from the headers)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, torch.Tensor] = {}
        for file in artifact.weight_files(directory):
            with self._open(file, safe_open) as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    view = handle.get_slice(key)
                    dtype = FLOAT_DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise ModelFormatError(
                            f"{file}: tensor {key} is stored as {view.get_dtype()}; model weights "
                            f"are one of {', '.join(FLOAT_DTYPES)}"
                        )
                    self.file_of[key] = file
                    self.shapes[key] = torch.empty(view.get_shape(), dtype=dtype, device="meta")

    @staticmethod
    def _open(file: Path, safe_open):
        from safetensors import SafetensorError

        try:
            return safe_open(file, framework="pt")
        except (SafetensorError, OSError) as err:
            raise ModelFormatError(f"{file}: cannot read safetensors ({err})") from None

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with self._open(self.file_of[key], safe_open) as handle:
            return handle.get_tensor(key)


def _meta_model(source: SafetensorsSource, args: ModelArgs, dtype: torch.dtype | None):
    """The model on the meta device with the stored dtypes (or `dtype`), names and shapes
    checked as `lmforge.load` checks them."""
    from lmforge.api import load_weights

    state = models.hf_state_dict_to_ours(dict(source.shapes), args, source.directory)
    with torch.device("meta"):
        model = models.new_model(args)
    load_weights(model, state, source=source.directory, device="meta", dtype=dtype)
    return model.eval()


class _TensorMaker:
    """Makes the stored tensors of the plan for real, one HF tensor at a time: `take(key)`
    reads, casts and quantizes the tensor that `key` belongs to on first use and keeps its
    other keys (the scale, zero point) until they are taken."""

    def __init__(
        self,
        source: SafetensorsSource,
        source_args: ModelArgs,
        spec: QuantSpec,
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        flat: FlatState,
        modules: list[str],
    ) -> None:
        self.source, self.spec, self.device, self.dtype, self.flat = (
            source,
            spec,
            device,
            dtype,
            flat,
        )
        self.quantized = {models.ours_to_hf(f"{m}.weight", source_args) for m in modules}
        self.config = torchao_config(spec.scheme, spec.group_size, device)
        self.key_of = {models.hf_to_ours(key, source_args): key for key in source.shapes}
        self.args = source_args
        # a tied source stores no separate output; quantizing it alone starts from the embedding
        self.untied = (
            {"output.weight": "tok_embeddings.weight"} if source_args.tie_embeddings else {}
        )
        self.pending: dict[str, torch.Tensor] = {}

    def take(self, key: str) -> torch.Tensor:
        if key not in self.pending:
            assert not self.pending, f"keys left unwritten: {sorted(self.pending)}"
            self.pending = self._make(self.flat.owner[key])
        return self.pending.pop(key)

    def _make(self, name: str) -> dict[str, torch.Tensor]:
        ours = models.hf_to_ours(name, self.args)
        tensor = self.source.read(self.key_of[self.untied.get(ours, ours)])
        tensor = tensor.to(device=self.device, dtype=self.dtype or tensor.dtype)
        if casts_to_bfloat16(self.spec, self.device):
            tensor = tensor.to(torch.bfloat16)
        if name in self.quantized:
            tensor = quantize_weight(tensor, self.config)
        tensors, metadata = flatten_tensor(name, tensor.to("cpu"), self.spec)
        self._check(name, tensors, metadata)
        return tensors

    def _check(self, name: str, tensors: dict, metadata: dict) -> None:
        """The real tensor must be what the meta-device plan promised (names, bytes, torchao's
        description), or the shards and their metadata would not describe the data."""
        planned = {key for key, owner in self.flat.owner.items() if owner == name}
        sizes = {key: t.numel() * t.element_size() for key, t in tensors.items()}
        if (
            set(tensors) != planned
            or any(sizes[key] != self.flat.sizes[key] for key in planned)
            or metadata[name] != self.flat.metadata[name]
        ):
            raise RuntimeError(
                f"streaming quantization: {name} came out unlike its meta-device plan "
                f"({sorted(tensors)} vs {sorted(planned)}); quantize with --no-stream "
                "(stream=False)"
            )


def quantize_streaming(
    source: Path,
    out: Path,
    spec: QuantSpec,
    *,
    device: str | torch.device,
    dtype: str | torch.dtype | None,
    max_shard_size: str | int,
    overwrite: bool = False,
) -> QuantizeResult:
    """Quantize the safetensors model directory `source` tensor by tensor into `out`."""
    from lmforge.api import load_tokenizer_for, parse_dtype, read_args

    require_torchao()
    if is_quantized(source):
        raise ConfigError(
            f"{source}: is already quantized ({_scheme_of(source)}); quantize the original"
        )
    device = torch.device(device)
    dtype = parse_dtype(dtype)
    args = read_args(source)
    group_size_given = spec.group_size is not None
    spec = replace(spec, group_size=check_group_size(spec, args, device))
    reader = SafetensorsSource(source)
    model = _meta_model(reader, args, dtype)
    original = SizeReport(disk_bytes=weight_file_bytes(source), memory_bytes=module_bytes(model))
    start_dtype = next(model.parameters()).dtype
    modules = quantize_model(model, spec, device=device)  # on meta: the plan
    notes = quantize_notes(
        args, model, spec, device, start_dtype, group_size_given=group_size_given
    )
    flat, _ = flatten_state(hf_state(model), spec)
    maker = _TensorMaker(reader, args, spec, device=device, dtype=dtype, flat=flat, modules=modules)
    path = write_quantized(
        out,
        model,
        load_tokenizer_for(source, args),
        parent=source,
        spec=spec,
        device=device,
        modules=modules,
        flat=flat,
        produce=maker.take,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
    )
    result = finish_result(path, spec, modules, original, model, source, notes)
    result.streamed = True
    return result


def _scheme_of(directory: Path) -> str:
    lineage_path = directory / artifact.LINEAGE_NAME
    if lineage_path.exists():
        scheme = (artifact.read_json(lineage_path).get("quantization") or {}).get("scheme")
        if scheme:
            return scheme
    return "torchao"
