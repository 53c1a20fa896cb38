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
(or a torchao `quantization_config` written by transformers) and reads the weights with
`lmforge.quantize.stored` (which imports nothing above it, so that `lmforge.api` may use it).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from lmforge import artifact
from lmforge.errors import ConfigError
from lmforge.models.llama import ModelArgs, Transformer
from lmforge.models.llama import hf as llama_hf
from lmforge.quantize.stored import (  # noqa: F401 (is_quantized, unpack_int4: re-exported)
    PACKED_METADATA_KEY,
    PACKED_QUANT_METHOD,
    PACKED_SUFFIX,
    is_quantized,
    pack_int4,
    require_torchao,
    unpack_int4,
)
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
    from lmforge.api import detect_format, load

    spec = QuantSpec(scheme=scheme, group_size=group_size, quantize_output=quantize_output)
    check_scheme(scheme, device)
    loaded = load(source, device=device, dtype=dtype)
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

    from lmforge.api import generation_config

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
        generation = generation_config(args, loaded.tokenizer)
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
