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
description of each tensor in the safetensors metadata, repeated in every shard), and config.json
carries a torchao `quantization_config` (transformers' `TorchAoConfig.to_dict()` layout): this is
what transformers' `TorchAoHfQuantizer` reads (safetensors only; it rebuilds each subclass from
the metadata), and what vLLM's torchao integration reads. Every scheme loads there as it is:
int8-wo anywhere, int4-wo made on the CPU anywhere (torchao's CPU int4 tensor keeps one value
per int8 byte, so its file is ~1/2 of bf16, like int8), int4-wo made on CUDA on CUDA only
(tinygemm packs two values per byte).

`pack_int4` (`--pack-int4`) stores the CPU int4 values two per byte (`_weight_qdata_int4x2`),
which makes the file really ~1/4 of bf16, but neither transformers nor vLLM can read that packing:
such an artifact says so in lmforge.json (`quantization.hf_loadable: false`), `lmforge quantize`
warns on the console, and config.json's `quantization_config` names a torchao config type that
does not exist, so transformers and vLLM stop with an error ("Failed to find class
LmforgePackedInt4...") instead of loading random weights. Artifacts written before this change
carry `quant_method: "lmforge-int4x2"` (which transformers skips with a warning); `lmforge.load`
reads both.

The stage (`lmforge.quantize.stage.quantize_artifact`) streams a safetensors source: it plans
the output on the meta device (names, shapes, shards, metadata: this module's code, as the
whole-model path runs it), then reads, quantizes and writes one tensor at a time, so the host
holds one weight plus the shard being written (at most `max_shard_size`), never the whole model
(`lmforge.quantize.streaming`); other sources (a preset, Meta or torchtitan checkpoints) are
loaded whole. Both give the same tensors.

lmforge.json records `"quantization": {scheme, group_size, modules, ...}`; `lmforge.load` sees it
(or a torchao `quantization_config` written by transformers) and reads the weights with
`lmforge.quantize.stored` (which imports nothing above it, so that `lmforge.api` may use it).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from lmforge import artifact, models
from lmforge.errors import ConfigError
from lmforge.models import ModelArgs, Transformer
from lmforge.quantize.schemes import INT4_GROUP_SIZES, SCHEMES, default_int4_group_size
from lmforge.quantize.stored import (  # noqa: F401 (is_quantized, unpack_int4: re-exported)
    PACKED_CONFIG_TYPE,
    PACKED_METADATA_KEY,
    PACKED_SUFFIX,
    is_quantized,
    pack_int4,
    require_torchao,
    unpack_int4,
)
from lmforge.sizes import module_bytes

DEFAULT_INT4_GROUP_SIZE = INT4_GROUP_SIZES[0]  # where it divides every input size
TINYGEMM_GROUP_SIZES = tuple(sorted(INT4_GROUP_SIZES))  # what the CUDA int4 kernel accepts
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
PACKED_WARNING = (
    "int4 values packed two per byte (--pack-int4): transformers and vLLM cannot load this "
    "artifact (they stop with an error naming {type}); only lmforge.load reads it"
)


@dataclass(frozen=True)
class QuantSpec:
    """What to quantize and how (recorded in lmforge.json under "quantization")."""

    scheme: str
    group_size: int | None = None  # None: one scale per output row (int8-wo only)
    quantize_output: bool = False  # the output projection; embeddings are never quantized
    pack_int4: bool = False  # CPU int4: two values per byte on disk (lmforge-only artifact)


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
    warnings: list[str] = field(default_factory=list)  # what the console must shout
    streamed: bool = False  # read and written one tensor at a time


@dataclass
class FlatState:
    """A quantized state dict flattened for safetensors, in the order it is written:
    `sizes` (bytes) of every stored key, the HF tensor each key belongs to (`owner`), and the
    safetensors metadata every shard carries (torchao's description of each tensor)."""

    sizes: dict[str, int]
    owner: dict[str, str]
    metadata: dict[str, str]
    packed_keys: list[str]


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


def linear_input_sizes(args: ModelArgs, *, quantize_output: bool) -> dict[str, tuple[str, int]]:
    """linear -> (the size's name, its input size): the axis the quantization groups split."""
    sizes = {"dim": args.dim, "q_dim": args.num_heads * args.head_dim, "ffn_dim": args.ffn_dim}
    inputs = {linear: (key, sizes[key]) for linear, key in BLOCK_LINEARS.items()}
    return {**inputs, "output": ("dim", args.dim)} if quantize_output else inputs


def check_group_size(spec: QuantSpec, args: ModelArgs, device: str | torch.device) -> int | None:
    """The group size to use; a ConfigError if it does not divide the input size of every
    quantized linear (or is not a tinygemm size on CUDA). int4 without one takes the largest of
    INT4_GROUP_SIZES that divides them all (256 where it does; `group_size_note` says why not)."""
    group_size = spec.group_size
    inputs = linear_input_sizes(args, quantize_output=spec.quantize_output)
    if group_size is None:
        if spec.scheme == "int8-wo":
            return None
        group_size = default_int4_group_size(size for _, size in inputs.values())
        if group_size is None:
            shown = ", ".join(f"{key} {size}" for key, size in sorted(set(inputs.values())))
            raise ConfigError(
                f"no int4 group size of {', '.join(map(str, INT4_GROUP_SIZES))} divides every "
                f"quantized linear's input size ({shown}); give a group_size (--group-size) "
                "that does (the cpu takes any divisor)"
            )
    if group_size <= 0:
        raise ConfigError(f"group_size {group_size} must be a positive integer")
    for linear, (size_key, size) in inputs.items():
        if size % group_size:
            raise ConfigError(
                f"group_size {group_size} does not divide the input size {size} "
                f"of {linear} ({size_key}); choose a divisor of {size}"
            )
    on_cuda = torch.device(device).type == "cuda"
    if spec.scheme == "int4-wo" and on_cuda and group_size not in TINYGEMM_GROUP_SIZES:
        raise ConfigError(
            f"group_size {group_size} is not supported by the CUDA int4 kernel; allowed: "
            f"{', '.join(map(str, TINYGEMM_GROUP_SIZES))}"
        )
    return group_size


def group_size_note(args: ModelArgs, spec: QuantSpec) -> str:
    """Why int4 runs in groups of `spec.group_size` (chosen by `check_group_size`, none given)
    rather than of the default."""
    inputs = linear_input_sizes(args, quantize_output=spec.quantize_output)
    linear, (size_key, size) = next(
        (linear, entry) for linear, entry in inputs.items() if entry[1] % DEFAULT_INT4_GROUP_SIZE
    )
    return (
        f"int4 group size {spec.group_size}: the default {DEFAULT_INT4_GROUP_SIZE} does not "
        f"divide the input size {size} of {linear} ({size_key}), and {spec.group_size} is the "
        f"largest of {', '.join(map(str, INT4_GROUP_SIZES))} that divides every quantized "
        "linear's (--group-size chooses another)"
    )


def check_packing(spec: QuantSpec, device: str | torch.device) -> None:
    """`pack_int4` packs the CPU int4 tensor's values; a ConfigError for anything else."""
    if spec.pack_int4 and (spec.scheme != "int4-wo" or torch.device(device).type != "cpu"):
        raise ConfigError(
            f"pack_int4 (--pack-int4) packs int4-wo made on the cpu; not {spec.scheme} on "
            f"{torch.device(device).type} (CUDA int4 is packed two per byte already)"
        )


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


def casts_to_bfloat16(spec: QuantSpec, device: str | torch.device) -> bool:
    """int4 on CUDA computes in bfloat16 (tinygemm needs it): the whole model is cast first."""
    return spec.scheme == "int4-wo" and torch.device(device).type == "cuda"


@torch.no_grad()
def quantize_model(
    model: Transformer, spec: QuantSpec, *, device: str | torch.device | None = None
) -> list[str]:
    """Quantize `model` in place with torchao, with the kernels of `device` (default: the
    device its weights are on; a meta-device model takes the device it plans for); returns
    the quantized module names. int4 on CUDA casts the model to bfloat16 (tinygemm needs it)."""
    device = device if device is not None else model.norm.weight.device
    check_scheme(spec.scheme, device)  # imports torchao
    from torchao.quantization import quantize_

    group_size = check_group_size(spec, model.args, device)
    if casts_to_bfloat16(spec, device):
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


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, config) -> torch.Tensor:
    """One linear's weight [out, in] quantized with a torchao config, as `quantize_model` does
    it inside the model (the same `quantize_` handler, on a bias-free linear of that shape)."""
    from torchao.quantization import quantize_

    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight)
    quantize_(linear, config)
    quantized = linear.weight
    assert type(quantized) is not nn.Parameter and type(quantized) is not torch.Tensor
    return quantized.detach()


def quantize_notes(
    args: ModelArgs,
    model: Transformer,
    spec: QuantSpec,
    device,
    start_dtype: torch.dtype,
    *,
    group_size_given: bool = True,
) -> list[str]:
    """What the quantization changed or chose besides the linears (an int4 group size other
    than the default when none was given, casts, untying, padding)."""
    notes = []
    chose = spec.scheme == "int4-wo" and not group_size_given
    if chose and spec.group_size != DEFAULT_INT4_GROUP_SIZE:
        notes.append(group_size_note(args, spec))
    end_dtype = model.norm.weight.dtype
    if end_dtype != start_dtype:
        notes.append(f"cast {start_dtype} -> {end_dtype} (the CUDA int4 kernel needs bfloat16)")
    if casts_to_bfloat16(spec, device):
        sizes = {args.dim, args.ffn_dim, args.num_heads * args.head_dim}
        if any(size % TINYGEMM_PAD_TO for size in sizes):
            notes.append(
                f"the CUDA int4 layout pads input sizes to a multiple of {TINYGEMM_PAD_TO} "
                f"({sorted(sizes)} here), so these weights shrink less than 4x"
            )
    if args.tie_embeddings != model.args.tie_embeddings:
        notes.append("untied the output projection from the embeddings to quantize it alone")
    if spec.scheme == "int4-wo" and torch.device(device).type == "cpu" and not spec.pack_int4:
        notes.append(
            "int4 values are stored one per byte (torchao's CPU int4 tensor, which transformers "
            "and vLLM read), so the file is ~1/2 of bf16; --pack-int4 halves it again for "
            "lmforge only"
        )
    return notes


def finish_result(
    path: Path,
    spec: QuantSpec,
    modules: list[str],
    original: SizeReport,
    model: Transformer,
    source_dir: Path | None,
    notes: list[str],
) -> QuantizeResult:
    """The sizes before and after; `model` is the quantized one (real or on the meta device)."""
    if source_dir is not None:
        hf_names = [
            models.ours_to_hf(f"{m}.weight", model.args).removesuffix(".weight") for m in modules
        ]
        original.linear_bytes = sum(
            size
            for key, size in stored_bytes(source_dir).items()
            if key.removesuffix(".weight") in hf_names
        )
    quantized = size_report(path, model, modules)
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
        models.ours_to_hf(f"{m}.weight", model.args).removesuffix("weight") for m in modules
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


def hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's state dict with HF names (a tied output is not stored), on the CPU (a
    meta-device model's stays on meta)."""
    state = models.ours_state_dict_to_hf(model.state_dict(), model.args)
    return {name: t.detach() if t.is_meta else t.detach().to("cpu") for name, t in state.items()}


def flatten_tensor(name: str, tensor: torch.Tensor, spec: QuantSpec):
    """One HF tensor as the safetensors keys it is stored under (torchao's flattening, then
    the optional int4 packing) -> (tensors, metadata)."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    tensors, metadata = flatten_tensor_state_dict({name: tensor})
    del metadata["tensor_names"]  # the artifact's list names every tensor (see flatten_state)
    if spec.pack_int4:
        for key in list(tensors):
            if key.endswith("._weight_qdata") and _is_intx_int4(metadata, key):
                tensors[key + PACKED_SUFFIX] = pack_int4(tensors.pop(key))
    return tensors, metadata


def flatten_state(
    state: dict[str, torch.Tensor], spec: QuantSpec
) -> tuple[FlatState, dict[str, torch.Tensor]]:
    """A quantized HF state dict flattened tensor by tensor (what torchao's
    `flatten_tensor_state_dict` gives for the whole dict, in the same order)."""
    flat, metadata, sizes, owner = {}, {}, {}, {}
    for name, tensor in state.items():
        tensors, described = flatten_tensor(name, tensor, spec)
        metadata.update(described)
        for key, value in tensors.items():
            flat[key] = value
            sizes[key] = value.numel() * value.element_size()
            owner[key] = name
    metadata["tensor_names"] = json.dumps(list(state))
    metadata["format"] = "pt"
    packed_keys = [key for key in flat if key.endswith(PACKED_SUFFIX)]
    if packed_keys:
        metadata[PACKED_METADATA_KEY] = json.dumps(packed_keys)
    return FlatState(sizes, owner, metadata, packed_keys), flat


def save_quantized(
    loaded,
    directory: str | Path,
    *,
    spec: QuantSpec,
    modules: list[str],
    max_shard_size: str | int = artifact.DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a `LoadedModel` quantized by `quantize_model(model, spec)` (which returned
    `modules`) as an artifact, atomically; returns its path."""
    require_torchao()
    device = loaded.model.norm.weight.device
    spec = replace(spec, group_size=check_group_size(spec, loaded.model.args, device))
    flat, tensors = flatten_state(hf_state(loaded.model), spec)
    return write_quantized(
        directory,
        loaded.model,
        loaded.tokenizer,
        parent=loaded.source,
        spec=spec,
        device=device,
        modules=modules,
        flat=flat,
        produce=tensors.pop,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
    )


def write_quantized(
    directory: str | Path,
    model: Transformer,
    tokenizer,
    *,
    parent: str | Path,
    spec: QuantSpec,
    device: str | torch.device,
    modules: list[str],
    flat: FlatState,
    produce: Callable[[str], torch.Tensor],
    max_shard_size: str | int,
    overwrite: bool = False,
) -> Path:
    """Write a quantized artifact atomically: weights as planned by `flat`, each key's tensor
    got from `produce(key)` shard by shard, in order; `model` (real, or quantized on the meta
    device) gives the config and the description in lmforge.json."""
    import torchao
    from torchao.core.config import config_to_dict

    from lmforge.api import write_model_files

    args = model.args
    config = torchao_config(spec.scheme, spec.group_size, device)
    first = model.get_submodule(modules[0]).weight
    tensor_type = type(first).__name__
    packed = bool(flat.packed_keys)
    record_quantization = {
        "scheme": spec.scheme,
        "group_size": spec.group_size,
        "quantize_output": spec.quantize_output,
        "modules": [
            models.ours_to_hf(f"{m}.weight", args).removesuffix(".weight") for m in modules
        ],
        "not_quantized": ["model.embed_tokens"] + ([] if spec.quantize_output else ["lm_head"]),
        "tensor_type": tensor_type,
        "compute_dtype": str(first.dtype).removeprefix("torch."),
        "torchao_version": torchao.__version__,
        "torchao_config": config_to_dict(config),
        "storage": "torchao flattened safetensors"
        + (", int4 qdata packed two per byte (_weight_qdata_int4x2)" if packed else ""),
        "hf_loadable": not packed,
    }
    if packed:
        record_quantization["note"] = PACKED_WARNING.format(type=PACKED_CONFIG_TYPE)
    if tensor_type == "Int4TilePackedTo4dTensor":
        record_quantization["note"] = "tinygemm layout: loads on CUDA only"
    directory = Path(directory)
    with artifact.atomic_directory(directory, overwrite=overwrite) as staging:
        max_bytes = artifact.parse_size(max_shard_size)
        write_shards(flat, produce, staging, max_bytes)
        hf_config = models.args_to_hf_config(args, first.dtype)
        hf_config["quantization_config"] = _quantization_config(spec, config, packed)
        record = artifact.lineage_record(
            stage="quantize",
            parent=parent,
            config={**asdict(spec), "device": str(torch.device(device))},
        )
        record["quantization"] = record_quantization
        write_model_files(staging, args, hf_config, tokenizer, record)
    return directory


def _quantization_config(spec: QuantSpec, config, packed: bool) -> dict:
    """config.json's `quantization_config`: transformers' TorchAoConfig layout. Packed int4
    names a torchao config type that does not exist, so that transformers and vLLM (which
    both rebuild it with torchao's `config_from_dict`) refuse the artifact with an error."""
    from torchao.core.config import config_to_dict

    quant_type = config_to_dict(config)
    if packed:
        quant_type = {
            "_type": PACKED_CONFIG_TYPE,
            "_version": 1,
            "_data": {"scheme": spec.scheme, "group_size": spec.group_size},
        }
    return {
        "quant_method": "torchao",
        "quant_type": {"default": quant_type},
        "modules_to_not_convert": [] if spec.quantize_output else ["lm_head"],
        "include_input_output_embeddings": False,
        "untie_embedding_weights": False,
        **({"note": PACKED_WARNING.format(type=PACKED_CONFIG_TYPE)} if packed else {}),
    }


def _is_intx_int4(metadata: dict, key: str) -> bool:
    tensor_name = key.removesuffix("._weight_qdata") + ".weight"
    described = json.loads(metadata.get(tensor_name, "{}"))
    target = described.get("_data", {}).get("target_dtype", {})
    return described.get("_type") == "IntxUnpackedToInt8Tensor" and target.get("_data") == "int4"


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Keys in order, cut into shards of at most `max_shard_bytes` (a larger tensor gets one of
    its own)."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for key, size in sizes.items():
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(key)
        shard_bytes += size
    return shards


def write_shards(
    flat: FlatState,
    produce: Callable[[str], torch.Tensor],
    directory: Path,
    max_shard_bytes: int,
) -> None:
    """Safetensors shards (+ index when more than one), each carrying the full torchao metadata
    (transformers merges it from every shard, and needs every tensor's name in each); only one
    shard's tensors are held at a time."""
    from safetensors.torch import save_file

    shards = plan_shards(flat.sizes, max_shard_bytes)
    if len(shards) == 1:
        tensors = {key: produce(key).contiguous() for key in shards[0]}
        save_file(tensors, directory / artifact.WEIGHTS_NAME, metadata=flat.metadata)
        return
    weight_map = {}
    for number, keys in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: produce(key).contiguous() for key in keys}
        save_file(tensors, directory / name, metadata=flat.metadata)
        del tensors
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": sum(flat.sizes.values())}, "weight_map": weight_map}
    artifact.write_json(directory / artifact.INDEX_NAME, index)
