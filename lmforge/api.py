"""Load any supported model source into a `LoadedModel`, and save one as an artifact.

Sources: a preset name (random init), a Hugging Face directory of a registered family (Llama,
Qwen3), an lmforge artifact (the same, plus lmforge.json), or Meta's original download (`params.json` + `consolidated.NN.pth`,
at the top level or under `original/`), or a torchtitan DCP checkpoint (with `model_config`
naming the model), or a Hugging Face hub id (`meta-llama/Llama-3.2-1B`: downloaded into the
cache on first use, see `lmforge.hub.cached_model`). Pickle files are read with `weights_only=True` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge import artifact, hub, models
from lmforge.errors import ConfigError, HubError, ModelFormatError
from lmforge.models import PRESETS, ModelArgs, Transformer, get_preset
from lmforge.models.moe import keeps_fp32, use_quantized_experts
from lmforge.quantize import stored

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object | None  # lmforge.data.tokenizer.Tokenizer
    config: ModelArgs
    source: str
    lineage: dict = field(default_factory=dict)


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else as torch.device."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ConfigError(
            f"device {device!r} is not valid; allowed: auto, cpu, cuda, cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device} asked for, but CUDA is not available here; use cpu")
    return device


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelFormatError(
            f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}"
        ) from None


def _meta_dir(path: Path) -> Path | None:
    for candidate in (path, path / "original"):
        if (candidate / "params.json").exists() and any(candidate.glob("consolidated.*.pth")):
            return candidate
    return None


def local_source(source: str | Path, *, weights: bool = True) -> str | Path:
    """`source` itself, or for a hub id its directory in the local cache (downloaded on first
    use; with `weights=False` only its config, enough for the shape and the format)."""
    if isinstance(source, str) and source not in PRESETS and hub.is_repo_id(source):
        try:
            return hub.cached_model(source, weights=weights)
        except HubError as err:
            raise HubError(f"{source}: no such local directory, and as a hub id: {err}") from None
    return source


def detect_format(source: str | Path) -> str:
    """'preset', 'hf' (HF directory or artifact), 'meta' or 'torchtitan'; a ModelFormatError
    otherwise. A hub id is the format of its cached copy (its config is fetched if needed)."""
    if isinstance(source, str) and source in PRESETS:
        return "preset"
    path = Path(local_source(source, weights=False))
    if not path.exists():
        raise ModelFormatError(
            f"{path}: no such file or directory (and not a preset: {', '.join(PRESETS)}, nor a "
            "hub id namespace/name)"
        )
    if not path.is_dir():
        raise ModelFormatError(f"{path}: is a file; a model source is a directory or a preset name")
    if (path / artifact.CONFIG_NAME).exists():
        return "hf"
    if _meta_dir(path) is not None:
        return "meta"
    if models.torchtitan.find_checkpoint(path) is not None:
        models.torchtitan.check_torchtitan_checkpoint(path)  # names what a foreign DCP dir lacks
        return "torchtitan"
    raise ModelFormatError(
        f"{path}: not a model directory: expected config.json (Hugging Face / lmforge artifact), "
        "params.json + consolidated.NN.pth (Meta original) or a torchtitan DCP checkpoint "
        "(.metadata + *.distcp)"
    )


def read_args(source: str | Path, *, model_config: str | None = None) -> ModelArgs:
    """The model's hyperparameters without reading any weights.

    `model_config` (a preset, a torchtitan flavor, or a directory or file with config.json /
    params.json) names the model of a torchtitan checkpoint, which does not record it.
    """
    source = local_source(source, weights=False)
    kind = detect_format(source)
    if kind == "torchtitan":
        return models.torchtitan.read_torchtitan_args(source, model_config)
    if model_config is not None:
        raise ModelFormatError(
            f"{source}: model_config (--model-config) is only for torchtitan checkpoints; "
            f"this {kind} source carries its own config"
        )
    if kind == "preset":
        return get_preset(str(source))
    path = Path(source)
    if kind == "hf":
        config_path = path / artifact.CONFIG_NAME
        return models.args_from_hf_config(artifact.read_json(config_path), config_path)
    params_path = _meta_dir(path) / "params.json"
    return models.args_from_meta_params(artifact.read_json(params_path), params_path)


def _read_meta_state(directory: Path, args: ModelArgs) -> dict[str, torch.Tensor]:
    shard_files = sorted(directory.glob("consolidated.*.pth"))
    shards = []
    for file in shard_files:
        try:
            shards.append(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        except Exception as err:  # pickle refusal, truncation, not a zip file
            raise ModelFormatError(
                f"{file}: cannot load as a weights-only checkpoint ({err})"
            ) from None
    return models.merge_meta_shards(shards, args, directory)


def read_state_dict(
    source: str | Path, args: ModelArgs, keep_quantized: bool = False
) -> dict[str, torch.Tensor]:
    """Our-named tensors of a HF/artifact, Meta or torchtitan directory, as stored (dtype
    unchanged; `keep_quantized`: see `load`)."""
    path = Path(local_source(source))
    kind = detect_format(path)
    if kind == "torchtitan":
        return models.torchtitan.read_torchtitan_checkpoint(path, args)[1]
    if kind == "meta":
        return _read_meta_state(_meta_dir(path), args)
    state = artifact.read_safetensors(path)
    if stored.is_compressed(path):  # compressed-tensors: unpacked, dequantized, plain weights
        state = stored.dequantized_state(state)
    return models.hf_state_dict_to_ours(state, args, path, keep_quantized)


def build_model(
    args: ModelArgs, *, device: str | torch.device = "cpu", dtype=torch.float32, seed=0
):
    """A freshly initialized model (meta-device build, then materialized and initialized)."""
    with torch.device("meta"):
        model = models.new_model(args)
    model.to_empty(device=device)
    model.tie_weights()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.init_weights()
    return model.to(dtype)


def _stored_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """A tensor's dtype once the weights are cast to `dtype` (None: kept): fp32 for the state a
    family keeps in fp32 (a MoE's selection bias), else `dtype`."""
    if dtype is None or not tensor.is_floating_point():
        return tensor.dtype
    return torch.float32 if keeps_fp32(name) else dtype


def with_new_state(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """`state` (a checkpoint's weights) plus, at zero, the non-parameter state `args` asks for
    and the checkpoint was saved without: DeepSeek-V3's selection bias turned on
    (`model.overrides.router_bias_update`) for a hub model that never had one."""
    with torch.device("meta"):
        model = models.new_model(args)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, tensor in model.state_dict().items():
        if name not in params and name not in state:
            state[name] = torch.zeros(tensor.shape, dtype=tensor.dtype)
    return state


def load_weights(
    model: Transformer, state: dict[str, torch.Tensor], *, source, device, dtype
) -> None:
    """Assign `state` into a (meta or materialized) model, checking names and shapes."""
    args = model.args
    if args.tie_embeddings:
        state.pop("output.weight", None)  # the tied copy some exports carry
    expected = {n for n in model.state_dict() if not (args.tie_embeddings and n == "output.weight")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelFormatError(
            f"{source}: weights do not match config.json: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    current = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(current[name].shape):
            raise ModelFormatError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(current[name].shape)}"
            )
    state = {n: t.to(device=device, dtype=_stored_dtype(n, t, dtype)) for n, t in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.init_buffers(device)


def load(
    source: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    with_tokenizer: bool = True,
    model_config: str | None = None,
    keep_quantized: bool = False,
) -> LoadedModel:
    """Load a preset (random init, float32 unless `dtype`), HF, artifact, Meta or torchtitan model.

    `dtype=None` keeps the stored dtype of the weights. `model_config` names the model of a
    torchtitan checkpoint (see `read_args`); a directory given there also supplies the tokenizer.
    `keep_quantized`: experts the hub's files hold quantized (gpt-oss's MXFP4) stay so
    (`moe.QuantizedExperts`: a quarter of bf16's memory; inference only, not saved), else they
    are dequantized into the other weights' dtype.
    """
    dtype = parse_dtype(dtype)
    source = local_source(source)
    kind = detect_format(source)
    args = read_args(source, model_config=model_config)
    if kind == "preset":
        model = build_model(args, device=device, dtype=dtype or torch.float32)
        return LoadedModel(model=model.eval(), tokenizer=None, config=args, source=str(source))
    path = Path(source)
    if kind == "hf" and (stored.is_quantized(path) or stored.is_compressed(path)):
        return _load_quantized(path, device=device, dtype=dtype, with_tokenizer=with_tokenizer)
    state = read_state_dict(path, args, keep_quantized)
    with torch.device("meta"):
        model = models.new_model(args)
    use_quantized_experts(model, state)
    load_weights(model, state, source=path, device=device, dtype=dtype)
    tokenizer_dir = path
    if kind == "torchtitan" and model_config is not None and Path(model_config).is_dir():
        tokenizer_dir = Path(model_config)  # a DCP checkpoint has none; the config's download may
    tokenizer = load_tokenizer_for(tokenizer_dir, args) if with_tokenizer else None
    lineage = {}
    if (path / artifact.LINEAGE_NAME).exists():
        lineage = artifact.read_json(path / artifact.LINEAGE_NAME)
    return LoadedModel(
        model=model.eval(), tokenizer=tokenizer, config=args, source=str(path), lineage=lineage
    )


def load_tokenizer_for(path: Path, args: ModelArgs):
    """The tokenizer stored with a model, or None; refuses one whose ids exceed the vocab."""
    candidates = [
        path / "tokenizer.json",
        path / "original" / "tokenizer.model",
        path / "tokenizer.model",
    ]
    if not any(c.exists() for c in candidates):
        return None
    from lmforge.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > args.vocab_size:
        raise ModelFormatError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{args.vocab_size}; they do not belong together"
        )
    return tokenizer


def save(
    loaded: LoadedModel,
    directory: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = artifact.DEFAULT_MAX_SHARD_BYTES,
    stage: str = "convert",
    parent: str | Path | None = None,
    config: dict | None = None,
    metrics: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `loaded` as an artifact directory (atomically); returns its path. An existing
    artifact at `directory` is replaced only with `overwrite`; see `artifact.check_output`."""
    return save_state(
        loaded.model.state_dict(),
        loaded.config,
        loaded.tokenizer,
        directory,
        dtype=dtype,
        max_shard_size=max_shard_size,
        stage=stage,
        parent=parent if parent is not None else loaded.source,
        config=config,
        metrics=metrics,
        overwrite=overwrite,
    )


def save_state(
    state: dict[str, torch.Tensor],
    args: ModelArgs,
    tokenizer,
    directory: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = artifact.DEFAULT_MAX_SHARD_BYTES,
    stage: str,
    parent: str | Path | None,
    config: dict | None = None,
    metrics: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a full (unsharded) state dict with our names as an artifact directory (not over
    `parent`, nor over an artifact unless `overwrite`)."""
    artifact.check_output(directory, inputs=[parent] if parent else [], overwrite=overwrite)
    dtype = parse_dtype(dtype)
    state = {n: t.to(_stored_dtype(n, t, dtype)) for n, t in state.items()}
    hf_state = models.ours_state_dict_to_hf(state, args)
    stored_dtype = next(iter(hf_state.values())).dtype
    directory = Path(directory)
    with artifact.atomic_directory(directory, overwrite=overwrite) as staging:
        max_bytes = artifact.parse_size(max_shard_size)
        artifact.write_safetensors(hf_state, staging, max_shard_bytes=max_bytes)
        record = artifact.lineage_record(stage=stage, parent=parent, config=config, metrics=metrics)
        write_model_files(
            staging, args, models.args_to_hf_config(args, stored_dtype), tokenizer, record
        )
    return directory


def write_model_files(staging: Path, args: ModelArgs, hf_config: dict, tokenizer, record) -> None:
    """What an artifact holds beside its weights: config.json, generation_config.json, the
    tokenizer's files, and last lmforge.json (`record`) with the directory's hash."""
    artifact.write_json(staging / artifact.CONFIG_NAME, hf_config)
    artifact.write_json(
        staging / artifact.GENERATION_CONFIG_NAME, generation_config(args, tokenizer)
    )
    if tokenizer is not None:
        tokenizer.save(staging)
    record["hash"] = artifact.directory_hash(staging)
    artifact.write_json(staging / artifact.LINEAGE_NAME, record)


def generation_config(args: ModelArgs, tokenizer) -> dict:
    bos, eos = args.bos_id, args.eos_id
    if tokenizer is not None:
        bos = tokenizer.bos_id if tokenizer.bos_id is not None else bos
        stops = sorted(tokenizer.stop_ids) if getattr(tokenizer, "stop_ids", None) else []
        eos = stops if len(stops) > 1 else (stops[0] if stops else eos)
    return {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}


def _check_float8_device(path: Path, state: dict, device: torch.device) -> None:
    """float8 weights (`--scheme fp8`) multiply on FP8 tensor cores (`torch._scaled_mm`) and
    are read by Triton's float8 conversions, both compute capability 8.9+ (Ada, Hopper): on an
    older GPU, one line instead of a kernel's error at the first product."""
    if device.type != "cuda":
        return
    float8 = any(
        type(t).__name__ == "Float8Tensor" or t.dtype == torch.float8_e4m3fn for t in state.values()
    )
    capability = torch.cuda.get_device_capability(device)
    if float8 and capability < (8, 9):
        raise ConfigError(
            f"{path}: fp8 weights (W8A8) need FP8 tensor cores, compute capability 8.9+ (Ada, "
            f"Hopper); this GPU is {capability[0]}.{capability[1]}: quantize the original with "
            "--scheme int8-wo or int4-wo, or load it on the CPU"
        )


def _load_quantized(
    source: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    with_tokenizer: bool = True,
):
    """A quantized artifact (torchao's, or compressed-tensors' as torchao's) as a `LoadedModel`
    whose linears hold torchao tensors."""
    stored.require_torchao()
    path = Path(source)
    args = read_args(path)
    lineage = {}
    if (path / artifact.LINEAGE_NAME).exists():
        lineage = artifact.read_json(path / artifact.LINEAGE_NAME)
    dtype = parse_dtype(dtype)
    if stored.is_compressed(path):  # ints and scales: any dtype computes them
        state = stored.read_compressed_state(path, args, dtype)
    else:
        state = stored.read_quantized_state(path, args)
    quantized = {n for n, t in state.items() if type(t) is not torch.Tensor}
    dtypes = {t.dtype for n, t in state.items() if n in quantized}
    if dtype is not None and dtypes and dtypes != {dtype}:
        raise ModelFormatError(
            f"{path}: a quantized artifact computes in the dtype it was quantized in "
            f"({', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}); load it with "
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
    _check_float8_device(path, state, device)
    with torch.device("meta"):
        model = models.new_model(args)
    use_quantized_experts(model, state)  # a MoE's experts kept quantized (compressed-tensors)
    load_weights(model, state, source=path, device=device, dtype=None)  # checks names, shapes
    for name in quantized:
        model.get_parameter(name).requires_grad_(False)  # torchao weights are not trained
    tokenizer = load_tokenizer_for(path, args) if with_tokenizer else None
    return LoadedModel(
        model=model.eval(), tokenizer=tokenizer, config=args, source=str(path), lineage=lineage
    )
