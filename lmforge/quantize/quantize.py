"""Weight-only quantization with torchao, as an artifact transform: quantize, save, load.

`quantize_model` swaps the weights of the chosen linears for torchao tensor subclasses with
`torchao.quantization.quantize_` (the compute is torchao's; nothing here multiplies matrices):

| scheme  | device | torchao config                                         | weight tensor             |
|---------|--------|--------------------------------------------------------|---------------------------|
| int8-wo | both   | Int8WeightOnlyConfig (per row, or PerGroup(g))         | Int8Tensor                |
| int4-wo | cpu    | IntxWeightOnlyConfig(int4, PerGroup(g)), symmetric     | IntxUnpackedToInt8Tensor  |
| int4-wo | cuda   | Int4WeightOnlyConfig(g, tile_packed_to_4d) (tinygemm)  | Int4TilePackedTo4dTensor  |

The artifact stores the state dict flattened by torchao's own safetensors helpers
(`torchao.prototype.safetensors`: `<module>._weight_qdata`, `_weight_scale`, ... plus a JSON
description of each tensor in the safetensors metadata), which is the layout transformers'
`TorchAoConfig` integration reads; config.json then carries a torchao `quantization_config`.
One exception: torchao's CPU int4 tensor holds one int4 value per int8 byte, so its `qdata` is
packed two values per byte on disk (`_weight_qdata_int4x2`) and unpacked on load, which makes
the file really ~1/4 of bf16. transformers and vLLM cannot read that packing: such an artifact
says so in lmforge.json (`quantization.hf_loadable: false`) and its config.json carries
`quant_method: "lmforge-int4x2"` (transformers warns that it does not know it and reports the
linear weights missing); `lmforge.load` reads it. Artifacts whose weights are all in torchao's
own layout (int8-wo anywhere, int4-wo made on CUDA) load in transformers as they are.

lmforge.json records `"quantization": {scheme, group_size, modules, ...}`; `lmforge.load` sees it
(or a torchao `quantization_config` written by transformers) and calls `load_quantized`.
"""

from __future__ import annotations

import json
import logging
import struct
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from lmforge import artifact
from lmforge.errors import ConfigError, ModelFormatError, UserError
from lmforge.models.llama import ModelArgs, Transformer
from lmforge.models.llama import hf as llama_hf
from lmforge.sizes import module_bytes

SCHEMES = ("int8-wo", "int4-wo")
DEFAULT_INT4_GROUP_SIZE = 256
TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)  # what the CUDA int4 kernel accepts
TINYGEMM_PAD_TO = 1024  # ...and it pads in_features to a multiple of this
# The linears of one transformer block, with the size of their input (the quantized axis).
BLOCK_LINEARS = {
    "attention.wq": "dim",
    "attention.wk": "dim",
    "attention.wv": "dim",
    "attention.wo": "q_dim",
    "feed_forward.w1": "dim",
    "feed_forward.w2": "ffn_dim",
    "feed_forward.w3": "dim",
}
PACKED_SUFFIX = "_int4x2"  # `<module>._weight_qdata_int4x2`: two int4 values per byte
PACKED_QUANT_METHOD = "lmforge-int4x2"
PACKED_METADATA_KEY = "lmforge_int4x2"  # safetensors metadata: JSON list of packed keys


@dataclass(frozen=True)
class QuantSpec:
    """What to quantize and how (recorded in lmforge.json under "quantization")."""

    scheme: str
    group_size: int | None = None  # None: one scale per output row (int8-wo only)
    quantize_output: bool = False  # the output projection; embeddings are never quantized


@dataclass
class SizeReport:
    """Bytes of one model: weight files on disk, parameters + buffers in memory, and the
    stored bytes of the quantized linears' weights next to what they take in bf16."""

    disk_bytes: int | None
    memory_bytes: int
    linear_bytes: int | None = None
    linear_bf16_bytes: int | None = None


@dataclass
class QuantizeResult:
    path: Path
    spec: QuantSpec
    modules: list[str]
    original: SizeReport
    quantized: SizeReport
    notes: list[str] = field(default_factory=list)


# ---- which schemes run where ----------------------------------------------------------------


def supported_schemes(device: str | torch.device) -> dict[str, str]:
    """Scheme -> the torchao weight tensor that runs it on `device` (only those with a kernel)."""
    device = torch.device(device)
    if device.type == "cpu":
        return {"int8-wo": "Int8Tensor", "int4-wo": "IntxUnpackedToInt8Tensor"}
    if device.type == "cuda":
        schemes = {"int8-wo": "Int8Tensor"}
        if _cuda_capability(device) >= (8, 0):  # tinygemm's tensor-core int4 kernel
            schemes["int4-wo"] = "Int4TilePackedTo4dTensor"
        return schemes
    return {}


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def require_torchao() -> None:
    """Import torchao (quietly), or a UserError naming the install command when it is missing."""
    if "torchao.prototype.safetensors.safetensors_support" in sys.modules:
        return
    # Its import warns about optional CUDA extensions (mxfp8, cutlass) and a pytree
    # registration, none of which weight-only quantization uses: keep them off the console.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.prototype.safetensors.safetensors_support
        import torchao.quantization  # noqa: F401
    except ImportError:
        raise UserError(
            "torchao is not installed; quantized models need it: pip install 'lmforge[quant]'"
        ) from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def check_scheme(scheme: str, device: str | torch.device) -> None:
    """A ConfigError (one line) for an unknown scheme or one without a kernel on `device`."""
    require_torchao()
    if scheme not in SCHEMES:
        raise ConfigError(
            f"quantization scheme {scheme!r} is unknown; allowed: {', '.join(SCHEMES)}"
        )
    working = supported_schemes(device)
    if scheme not in working:
        device = torch.device(device)
        where = device.type
        if device.type == "cuda":
            major, minor = _cuda_capability(device)
            where += f" (compute capability {major}.{minor}; int4 needs 8.0+)"
        works = ", ".join(working) if working else "none (quantize on cpu or cuda)"
        raise ConfigError(
            f"quantization scheme {scheme!r} has no kernel on {where}; schemes that work there: "
            f"{works}"
        )


def quantized_module_names(args: ModelArgs, *, quantize_output: bool) -> list[str]:
    """Our names of the linears a scheme quantizes: every block linear (+ `output`)."""
    names = [f"layers.{i}.{linear}" for i in range(args.num_layers) for linear in BLOCK_LINEARS]
    return [*names, "output"] if quantize_output else names


def check_group_size(spec: QuantSpec, args: ModelArgs, device: str | torch.device) -> int | None:
    """The group size to use (int4 default 256); a ConfigError if it does not divide the input
    size of every quantized linear (or is not a tinygemm size on CUDA)."""
    group_size = spec.group_size
    if group_size is None:
        if spec.scheme == "int8-wo":
            return None
        group_size = DEFAULT_INT4_GROUP_SIZE
    if group_size <= 0:
        raise ConfigError(f"group_size {group_size} must be a positive integer")
    in_features = {
        "dim": args.dim,
        "q_dim": args.num_heads * args.head_dim,
        "ffn_dim": args.ffn_dim,
    }
    for linear, size_key in BLOCK_LINEARS.items():
        if in_features[size_key] % group_size:
            raise ConfigError(
                f"group_size {group_size} does not divide the input size {in_features[size_key]} "
                f"of {linear} ({size_key}); choose a divisor of {in_features[size_key]}"
            )
    if spec.quantize_output and args.dim % group_size:
        raise ConfigError(
            f"group_size {group_size} does not divide the input size {args.dim} of output (dim)"
        )
    on_cuda = torch.device(device).type == "cuda"
    if spec.scheme == "int4-wo" and on_cuda and group_size not in TINYGEMM_GROUP_SIZES:
        raise ConfigError(
            f"group_size {group_size} is not supported by the CUDA int4 kernel; allowed: "
            f"{', '.join(map(str, TINYGEMM_GROUP_SIZES))}"
        )
    return group_size


def torchao_config(scheme: str, group_size: int | None, device: str | torch.device):
    """The torchao `AOBaseConfig` of a scheme on a device (see the module table)."""
    require_torchao()
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        PerGroup,
        PerRow,
    )
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    # set_inductor_config=False: torchao would otherwise change global inductor settings.
    if scheme == "int8-wo":
        granularity = PerRow() if group_size is None else PerGroup(group_size)
        return Int8WeightOnlyConfig(granularity=granularity, set_inductor_config=False)
    if torch.device(device).type == "cuda":
        # tile_packed_to_4d: tinygemm, shipped in torch itself (the default "plain" format
        # needs the separate mslk kernels package).
        return Int4WeightOnlyConfig(
            group_size=group_size,
            int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
            set_inductor_config=False,
        )
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))


# ---- quantize -------------------------------------------------------------------------------


def _untie_output(model: Transformer) -> None:
    """Give `output` its own copy of the embedding, so quantizing it leaves the input table."""
    model.output.weight = nn.Parameter(model.tok_embeddings.weight.detach().clone())
    model.args = model.args.replace(tie_embeddings=False)


@torch.no_grad()
def quantize_model(model: Transformer, spec: QuantSpec) -> list[str]:
    """Quantize `model` in place with torchao, with the kernels of the device its weights are
    on; returns the quantized module names. int4 on CUDA casts the model to bfloat16 (tinygemm
    needs it)."""
    device = model.norm.weight.device
    check_scheme(spec.scheme, device)  # imports torchao
    from torchao.quantization import quantize_

    group_size = check_group_size(spec, model.args, device)
    if spec.scheme == "int4-wo" and torch.device(device).type == "cuda":
        model.to(torch.bfloat16)
    if spec.quantize_output and model.args.tie_embeddings:
        _untie_output(model)
    names = quantized_module_names(model.args, quantize_output=spec.quantize_output)
    chosen = set(names)
    config = torchao_config(spec.scheme, group_size, device)
    quantize_(model, config, filter_fn=lambda module, fqn: fqn in chosen)
    for name in names:  # torchao skips a weight it cannot quantize silently; we do not
        weight = model.get_submodule(name).weight
        assert type(weight) is not nn.Parameter and type(weight) is not torch.Tensor, name
    return names


def quantize_artifact(
    source: str | Path,
    out: str | Path,
    *,
    scheme: str,
    group_size: int | None = None,
    quantize_output: bool = False,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
) -> QuantizeResult:
    """Load `source`, quantize it on `device` and write the quantized artifact to `out`.

    `dtype` casts the model first (default: keep the stored dtype; int4 on CUDA uses bf16).
    """
    import lmforge
    from lmforge.api import detect_format

    spec = QuantSpec(scheme=scheme, group_size=group_size, quantize_output=quantize_output)
    check_scheme(scheme, device)
    loaded = lmforge.load(source, device=device, dtype=dtype)
    if loaded.lineage.get("quantization"):
        scheme_done = loaded.lineage["quantization"]["scheme"]
        raise ConfigError(f"{source}: is already quantized ({scheme_done}); quantize the original")
    group = check_group_size(spec, loaded.config, device)
    spec = QuantSpec(scheme=scheme, group_size=group, quantize_output=quantize_output)
    source_dir = Path(source) if detect_format(source) == "hf" else None  # has safetensors
    original = SizeReport(
        disk_bytes=weight_file_bytes(source_dir) if source_dir else None,
        memory_bytes=module_bytes(loaded.model),
    )
    notes = []
    start_dtype = next(loaded.model.parameters()).dtype
    modules = quantize_model(loaded.model, spec)
    end_dtype = next(loaded.model.norm.parameters()).dtype
    if end_dtype != start_dtype:
        notes.append(f"cast {start_dtype} -> {end_dtype} (the CUDA int4 kernel needs bfloat16)")
    if spec.scheme == "int4-wo" and torch.device(device).type == "cuda":
        sizes = {
            loaded.config.dim,
            loaded.config.ffn_dim,
            loaded.config.num_heads * loaded.config.head_dim,
        }
        if any(size % TINYGEMM_PAD_TO for size in sizes):
            notes.append(
                f"the CUDA int4 layout pads input sizes to a multiple of {TINYGEMM_PAD_TO} "
                f"({sorted(sizes)} here), so these weights shrink less than 4x"
            )
    if loaded.config.tie_embeddings != loaded.model.args.tie_embeddings:
        notes.append("untied the output projection from the embeddings to quantize it alone")
    loaded.config = loaded.model.args
    path = save_quantized(loaded, out, spec=spec, modules=modules)
    if source_dir is not None:
        hf_names = [llama_hf.ours_to_hf(f"{m}.weight").removesuffix(".weight") for m in modules]
        original.linear_bytes = sum(
            size
            for key, size in stored_bytes(source_dir).items()
            if key.removesuffix(".weight") in hf_names
        )
    quantized = size_report(path, loaded.model, modules)
    original.linear_bf16_bytes = quantized.linear_bf16_bytes
    return QuantizeResult(path, spec, modules, original, quantized, notes)


# ---- sizes ----------------------------------------------------------------------------------


def weight_file_bytes(directory: Path) -> int:
    """Sum of the sizes of a model directory's safetensors files."""
    return sum(f.stat().st_size for f in artifact.weight_files(Path(directory)))


def stored_bytes(directory: Path) -> dict[str, int]:
    """Bytes of each tensor in a model directory's safetensors files, from their headers."""
    sizes = {}
    for file in artifact.weight_files(Path(directory)):
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        for key, info in header.items():
            if key != "__metadata__":
                begin, end = info["data_offsets"]
                sizes[key] = end - begin
    return sizes


def size_report(directory: Path, model: nn.Module, modules: list[str]) -> SizeReport:
    """Sizes of a quantized artifact and its loaded model; `modules` are our linear names."""
    prefixes = tuple(
        llama_hf.ours_to_hf(f"{m}.weight").removesuffix("weight") for m in modules
    )  # "model.layers.0.self_attn.q_proj." covers ._weight_qdata, ._weight_scale, ...
    linear = sum(size for key, size in stored_bytes(directory).items() if key.startswith(prefixes))
    bf16 = sum(model.get_submodule(m).weight.numel() * 2 for m in modules)
    return SizeReport(
        disk_bytes=weight_file_bytes(directory),
        memory_bytes=module_bytes(model),
        linear_bytes=linear,
        linear_bf16_bytes=bf16,
    )


# ---- int4 packing for storage ----------------------------------------------------------------


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], last dim even -> uint8 with two values per byte (element 2j in
    the low nibble, 2j+1 in the high one)."""
    assert values.dtype == torch.int8 and values.shape[-1] % 2 == 0, (values.dtype, values.shape)
    nibbles = (values.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [..., n] -> int8 [..., 2n] in [-8, 7]."""
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    both = torch.stack((low, high), dim=-1).flatten(-2)
    return (both ^ 8) - 8  # sign-extend the 4-bit two's complement


# ---- save -----------------------------------------------------------------------------------


def _quantization_config(spec: QuantSpec, config, packed: bool) -> dict:
    """config.json's `quantization_config`: transformers' TorchAoConfig layout, or a method name
    that transformers and vLLM do not know when the int4 values are packed."""
    if packed:
        return {
            "quant_method": PACKED_QUANT_METHOD,
            "scheme": spec.scheme,
            "group_size": spec.group_size,
            "note": "int4 values packed two per byte by lmforge; load with lmforge.load "
            "(transformers and vLLM cannot read this packing)",
        }
    from torchao.core.config import config_to_dict

    return {
        "quant_method": "torchao",
        "quant_type": {"default": config_to_dict(config)},
        "modules_to_not_convert": [] if spec.quantize_output else ["lm_head"],
        "include_input_output_embeddings": False,
        "untie_embedding_weights": False,
    }


def save_quantized(
    loaded,
    directory: str | Path,
    *,
    spec: QuantSpec,
    modules: list[str],
    max_shard_size: str | int = artifact.DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a `LoadedModel` quantized by `quantize_model(model, spec)` (which returned
    `modules`) as an artifact, atomically; returns its path."""
    require_torchao()
    import torchao
    from torchao.core.config import config_to_dict
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    from lmforge.api import _generation_config

    args = loaded.model.args
    device = loaded.model.norm.weight.device
    spec = replace(spec, group_size=check_group_size(spec, args, device))  # int4 default
    state = llama_hf.ours_state_dict_to_hf(loaded.model.state_dict(), args)
    state = {name: tensor.detach().to("cpu") for name, tensor in state.items()}
    tensors, metadata = flatten_tensor_state_dict(state)
    packed_keys = []
    for key in list(tensors):
        tensor = tensors[key]
        is_int4 = key.endswith("._weight_qdata") and tensor.dtype == torch.int8
        if is_int4 and _is_intx_int4(metadata, key):
            tensors[key + PACKED_SUFFIX] = pack_int4(tensors.pop(key))
            packed_keys.append(key + PACKED_SUFFIX)
    metadata["format"] = "pt"
    if packed_keys:
        metadata[PACKED_METADATA_KEY] = json.dumps(packed_keys)
    config = torchao_config(spec.scheme, spec.group_size, device)
    first = state[llama_hf.ours_to_hf(f"{modules[0]}.weight")]
    tensor_type = type(first).__name__
    hf_names = [llama_hf.ours_to_hf(f"{m}.weight").removesuffix(".weight") for m in modules]
    record_quantization = {
        "scheme": spec.scheme,
        "group_size": spec.group_size,
        "quantize_output": spec.quantize_output,
        "modules": hf_names,
        "not_quantized": ["model.embed_tokens"] + ([] if spec.quantize_output else ["lm_head"]),
        "tensor_type": tensor_type,
        "compute_dtype": str(first.dtype).removeprefix("torch."),
        "torchao_version": torchao.__version__,
        "torchao_config": config_to_dict(config),
        "storage": "torchao flattened safetensors"
        + (", int4 qdata packed two per byte (_weight_qdata_int4x2)" if packed_keys else ""),
        "hf_loadable": not packed_keys,
    }
    if packed_keys:
        record_quantization["note"] = (
            "transformers and vLLM cannot load this artifact (int4 packed by lmforge); "
            "lmforge.load reads it"
        )
    if tensor_type == "Int4TilePackedTo4dTensor":
        record_quantization["note"] = "tinygemm layout: loads on CUDA only"
    directory = Path(directory)
    with artifact.atomic_directory(directory) as staging:
        _write_shards(tensors, metadata, staging, artifact.parse_size(max_shard_size))
        hf_config = llama_hf.args_to_hf_config(args, first.dtype)
        hf_config["quantization_config"] = _quantization_config(spec, config, bool(packed_keys))
        artifact.write_json(staging / artifact.CONFIG_NAME, hf_config)
        generation = _generation_config(args, loaded.tokenizer)
        artifact.write_json(staging / artifact.GENERATION_CONFIG_NAME, generation)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save(staging)
        record = artifact.lineage_record(
            stage="quantize",
            parent=loaded.source,
            config={**asdict(spec), "device": str(torch.device(device))},
        )
        record["quantization"] = record_quantization
        record["hash"] = artifact.directory_hash(staging)
        artifact.write_json(staging / artifact.LINEAGE_NAME, record)
    return directory


def _is_intx_int4(metadata: dict, key: str) -> bool:
    tensor_name = key.removesuffix("._weight_qdata") + ".weight"
    described = json.loads(metadata.get(tensor_name, "{}"))
    target = described.get("_data", {}).get("target_dtype", {})
    return described.get("_type") == "IntxUnpackedToInt8Tensor" and target.get("_data") == "int4"


def _write_shards(
    tensors: dict[str, torch.Tensor], metadata: dict, directory: Path, max_shard_bytes: int
) -> None:
    """Safetensors shards (+ index when more than one), each carrying the full torchao metadata
    (transformers merges it from every shard)."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.contiguous()
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], directory / artifact.WEIGHTS_NAME, metadata=metadata)
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / name, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    artifact.write_json(directory / artifact.INDEX_NAME, index)


# ---- load -----------------------------------------------------------------------------------


def is_quantized(directory: Path) -> bool:
    """Whether a model directory holds torchao-quantized weights: our lineage says so, or its
    config.json has a torchao (or our packed) `quantization_config`."""
    directory = Path(directory)
    lineage_path = directory / artifact.LINEAGE_NAME
    if lineage_path.exists() and artifact.read_json(lineage_path).get("quantization"):
        return True
    config_path = directory / artifact.CONFIG_NAME
    if not config_path.exists():
        return False
    method = (artifact.read_json(config_path).get("quantization_config") or {}).get("quant_method")
    return method in ("torchao", PACKED_QUANT_METHOD)


def _read_flat(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    tensors, metadata = {}, {}
    for file in artifact.weight_files(directory):
        try:
            with safe_open(file, framework="pt") as handle:
                metadata.update(handle.metadata() or {})
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[key] = handle.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise ModelFormatError(f"{file}: cannot read safetensors ({err})") from None
    return tensors, metadata


def read_quantized_state(directory: Path) -> dict[str, torch.Tensor]:
    """Our-named state dict of a quantized artifact, torchao subclasses for quantized weights
    (on the CPU)."""
    require_torchao()
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict
    from torchao.prototype.safetensors.safetensors_utils import is_metadata_torchao

    directory = Path(directory)
    tensors, metadata = _read_flat(directory)
    for key in json.loads(metadata.get(PACKED_METADATA_KEY, "[]")):
        if key not in tensors:
            raise ModelFormatError(f"{directory}: packed tensor {key} is listed but absent")
        tensors[key.removesuffix(PACKED_SUFFIX)] = unpack_int4(tensors.pop(key))
    if not is_metadata_torchao(metadata):
        raise ModelFormatError(
            f"{directory}: the safetensors metadata does not describe torchao tensors; a "
            "quantized artifact is written by `lmforge quantize` or transformers' TorchAoConfig"
        )
    try:
        state, leftover = unflatten_tensor_state_dict(tensors, metadata)
    except ValueError as err:
        raise ModelFormatError(f"{directory}: cannot rebuild the torchao tensors ({err})") from None
    if leftover:
        raise ModelFormatError(
            f"{directory}: tensors not described by the metadata: {sorted(leftover)[:4]}"
        )
    return llama_hf.hf_state_dict_to_ours(state, directory)


def load_quantized(
    source: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    with_tokenizer: bool = True,
):
    """A quantized artifact as a `LoadedModel` whose linears hold torchao tensors."""
    from lmforge.api import LoadedModel, load_tokenizer_for, load_weights, parse_dtype, read_args

    require_torchao()
    path = Path(source)
    args = read_args(path)
    lineage = {}
    if (path / artifact.LINEAGE_NAME).exists():
        lineage = artifact.read_json(path / artifact.LINEAGE_NAME)
    state = read_quantized_state(path)
    quantized = {n for n, t in state.items() if type(t) is not torch.Tensor}
    stored = {t.dtype for n, t in state.items() if n in quantized}
    dtype = parse_dtype(dtype)
    if dtype is not None and stored and stored != {dtype}:
        raise ModelFormatError(
            f"{path}: a quantized artifact computes in the dtype it was quantized in "
            f"({', '.join(sorted(str(d).removeprefix('torch.') for d in stored))}); load it with "
            "dtype=None or that dtype, or quantize the original again in another dtype"
        )
    device = torch.device(device)
    for name in sorted(quantized):
        kind = type(state[name]).__name__
        if kind == "Int4TilePackedTo4dTensor" and device.type != "cuda":
            raise ModelFormatError(
                f"{path}: {name} is int4 in the CUDA tinygemm layout ({kind}), which has no kernel "
                f"on {device.type}; load it on cuda, or quantize the original on {device.type}"
            )
    with torch.device("meta"):
        model = Transformer(args)
    load_weights(model, state, source=path, device=device, dtype=None)  # checks names, shapes
    for name in quantized:
        model.get_parameter(name).requires_grad_(False)  # torchao weights are not trained
    tokenizer = load_tokenizer_for(path, args) if with_tokenizer else None
    return LoadedModel(
        model=model.eval(), tokenizer=tokenizer, config=args, source=str(path), lineage=lineage
    )
