"""Import torchtitan Llama 3 checkpoints (torch.distributed.checkpoint directories).

torchtitan's CheckpointManager (`torchtitan/components/checkpoint.py`) writes
`<dump_folder>/<checkpoint.folder, default "checkpoint">/step-N/` with DCP's `.metadata` and
one `__R_W.distcp` file per writer. Current versions flatten the model's parameters to the top
level (`tok_embeddings.weight`, `layers.0.attention.wq.weight`, `norm.weight`, `output.weight`)
next to `optimizer.*`, `lr_scheduler.*`, `dataloader.*` and `train_state.*`; older versions
nest them under `model.` in full checkpoints (and at the top level in model-weights-only ones),
and some carry the `freqs_cis` RoPE buffer. torchtitan 0.3 names the projections
`layers.N.attention.qkv_linear.wq.weight` (its fused `wqkv` is split back by a state-dict hook)
and the output `lm_head.weight`. All of these are read; only the model's tensors are loaded,
into preallocated tensors, in one process (DCP reshards FSDP/TP chunks on the way).

torchtitan's Llama 3 rotates adjacent pairs of each head (complex `freqs_cis`, Meta's
interleaved layout), ours rotates the two halves, so wq/wk are permuted once on import, like
torchtitan's own state-dict adapter does for its HF export.

A DCP checkpoint does not record num_heads (nor RoPE settings), so the caller names the model:
a preset, a torchtitan flavor, or a config.json / params.json. Safety: DCP's `.metadata` is a
pickle; it is read by an unpickler that builds only DCP's metadata classes, sizes and dtypes.
Tensors are read by DCP with `torch.load(weights_only=True)`; non-tensor entries (torchtitan's
pickled loss history, the data loader's state) are never read.
"""

from __future__ import annotations

import functools
import logging
import re
import warnings
from pathlib import Path

import torch

from lmforge import artifact, safe_dcp
from lmforge.errors import ModelFormatError
from lmforge.models.llama import hf as llama_hf
from lmforge.models.llama.args import PRESETS, ModelArgs, RopeScaling, get_preset
from lmforge.models.llama.model import Transformer

logger = logging.getLogger(__name__)

METADATA_NAME = safe_dcp.METADATA_NAME
_STEP_DIR_RE = re.compile(r"^step-(\d+)$")
# Our (= torchtitan's) parameter names; anything else under the model is unsupported.
_PARAM_RE = re.compile(
    r"^(tok_embeddings|norm|output)\.weight$"
    r"|^layers\.(\d+)\.(attention\.w[qkvo]|feed_forward\.w[123]|attention_norm|ffn_norm)\.weight$"
)
_MODEL_ROOTS = ("tok_embeddings.", "layers.", "norm.", "output.", "lm_head.")
# torchtitan 0.3 names -> ours (the `freqs_cis` buffer has no root above: never imported)
_RENAMES = [
    (re.compile(r"^(layers\.\d+\.attention\.)qkv_linear\.(w[qkv]\.weight)$"), r"\1\2"),
    (re.compile(r"^lm_head\.weight$"), "output.weight"),
]

# torchtitan `--model.flavor` names (torchtitan/models/llama3/__init__.py) -> lmforge presets.
# Current torchtitan applies the Llama 3.1 RoPE scaling (factor 8) to every flavor, also to 1B
# and 3B (Meta's Llama 3.2 uses 32); a checkpoint from a version without scaling needs a
# config.json / params.json instead.
_DEBUGMODEL = ModelArgs(
    dim=256,
    num_layers=6,  # taken from the checkpoint: 6 or 8 depending on the torchtitan version
    num_heads=16,
    num_kv_heads=16,
    ffn_dim=768,  # 2/3 * 4 * 256 rounded up to a multiple of 256
    vocab_size=2048,  # taken from the checkpoint: it followed the test tokenizer
    rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0),
    bos_id=None,
    eos_id=None,
)
TORCHTITAN_FLAVORS: dict[str, str | ModelArgs] = {
    "debugmodel": _DEBUGMODEL,
    "debugmodel_flex_attn": _DEBUGMODEL,
    "debugmodel_varlen_attn": _DEBUGMODEL,
    "1B": get_preset("llama3.2-1b").replace(rope_scaling=RopeScaling(factor=8.0)),
    "3B": get_preset("llama3.2-3b").replace(rope_scaling=RopeScaling(factor=8.0)),
    "8B": "llama3.1-8b",
    "8B_flex": "llama3.1-8b",
    "8B_varlen": "llama3.1-8b",
    "70B": "llama3.1-70b",
    "405B": "llama3.1-405b",
}
_CONFIG_HELP = (
    "pass --model-config: a preset ("
    + ", ".join(PRESETS)
    + "), a torchtitan flavor ("
    + ", ".join(f for f in TORCHTITAN_FLAVORS if "_" not in f)
    + "), or a directory or file with config.json / params.json"
)


def _load_metadata(directory: Path):
    try:
        return safe_dcp.load_metadata(directory)
    except safe_dcp.UnreadableCheckpointError as err:
        raise ModelFormatError(str(err)) from None


@functools.lru_cache(maxsize=8)
def _cached_entries(directory: str, _stamp: tuple) -> tuple[dict, list[str], str | None]:
    """({name: (shape, dtype)} of the tensor entries, the top-level entry names, and the first
    missing or truncated data file or None)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _load_metadata(Path(directory))
    tensors = {
        name: (tuple(entry.size), entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            end = int(info.offset) + int(info.length)
            needed[relative] = max(needed.get(relative, 0), end)
    problem = None
    for relative, end in sorted(needed.items()):
        file = Path(directory) / relative
        if not file.is_file():
            problem = f"data file {relative} is missing"
        elif file.stat().st_size < end:
            problem = f"data file {relative} is truncated"
        if problem:
            break
    groups = sorted({name.split(".")[0] for name in metadata.state_dict_metadata})
    return tensors, groups, problem


def _entries(directory: Path) -> tuple[dict, list[str], str | None]:
    stat = (directory / METADATA_NAME).stat()
    return _cached_entries(str(directory.resolve()), (stat.st_mtime_ns, stat.st_size))


# ---- finding the checkpoint and its model tensors -----------------------------------------


def find_checkpoint(path: str | Path) -> Path | None:
    """The DCP directory to read: `path` itself when it holds `.metadata`, else the newest
    complete `step-N` under `path` or `path/checkpoint` (a torchtitan dump folder); None when
    there is no DCP checkpoint there."""
    path = Path(path)
    if (path / METADATA_NAME).is_file():
        return path
    steps = []
    for folder in (path, path / "checkpoint"):
        if folder.is_dir():
            for child in folder.iterdir():
                match = _STEP_DIR_RE.match(child.name)
                if match and child.is_dir():
                    steps.append((int(match.group(1)), child))
    for _, child in sorted(steps, reverse=True):
        if not (child / METADATA_NAME).is_file():
            _warn_once(child, f"no {METADATA_NAME} (its save never finished)")
            continue
        try:
            problem = _entries(child)[2]
        except ModelFormatError as err:
            problem = str(err)
        if problem is None:
            return child
        _warn_once(child, problem)
    return None


_warned: set[tuple[str, str]] = set()


def _warn_once(directory: Path, problem: str) -> None:
    # find_checkpoint runs once per load step (detect, args, weights): say it once.
    if (str(directory), problem) not in _warned:
        _warned.add((str(directory), problem))
        logger.warning("%s: skipped, %s", directory, problem)


def _require_checkpoint(path: Path) -> Path:
    directory = find_checkpoint(path)
    if directory is None:
        raise ModelFormatError(
            f"{path}: not a DCP checkpoint: no {METADATA_NAME} here and no complete step-N "
            "directory under it (or under its checkpoint/ folder)"
        )
    return directory


def _our_name(name: str) -> str:
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


def _model_tensors(directory: Path) -> dict[str, tuple]:
    """{our name: (stored key, shape, dtype)} of the model weights in a DCP checkpoint."""
    tensors, groups, problem = _entries(directory)
    if problem is not None:
        raise ModelFormatError(f"{directory}: incomplete checkpoint: {problem}")
    for prefix in ("", "model."):
        model = {
            _our_name(key[len(prefix) :]): (key, *spec)
            for key, spec in tensors.items()
            if key.startswith(prefix) and key[len(prefix) :].startswith(_MODEL_ROOTS)
        }
        if "tok_embeddings.weight" in model or "layers.0.attention.wq.weight" in model:
            break
    else:
        if any(name.startswith("model.model.") for name in tensors):
            raise ModelFormatError(
                f"{directory}: an lmforge training checkpoint, not a torchtitan one; turn it "
                "into an artifact with `lmforge export`"
            )
        raise ModelFormatError(
            f"{directory}: no torchtitan Llama model weights inside (no tok_embeddings.weight "
            f"or layers.N.attention.wq.weight; top-level entries: {', '.join(groups[:8]) or 'none'})"
        )
    for name, (key, *_) in model.items():
        if not _PARAM_RE.match(name):
            raise ModelFormatError(
                f"{directory}: tensor {key} is not part of a plain Llama 3 model; "
                "LoRA adapters, qk-norm, biases and MoE layers are not supported"
            )
    return model


def _shape_summary(model: dict[str, tuple]) -> dict[str, int]:
    layers = {int(_PARAM_RE.match(name).group(2)) for name in model if name.startswith("layers.")}
    summary = {"num_layers": len(layers)}
    for key, name, axis in (
        ("vocab_size", "tok_embeddings.weight", 0),
        ("dim", "tok_embeddings.weight", 1),
        ("ffn_dim", "layers.0.feed_forward.w1.weight", 0),
        ("q_dim", "layers.0.attention.wq.weight", 0),
        ("kv_dim", "layers.0.attention.wk.weight", 0),
    ):
        if name in model and len(model[name][1]) == 2:
            summary[key] = model[name][1][axis]
    return summary


def _describe(summary: dict[str, int]) -> str:
    text = ", ".join(f"{key} {value}" for key, value in summary.items())
    matches = [
        name
        for name, preset in PRESETS.items()
        if all(
            getattr(preset, key) == summary.get(key)
            for key in ("dim", "num_layers", "vocab_size", "ffn_dim")
        )
        and preset.num_kv_heads * preset.head_dim == summary.get("kv_dim")
    ]
    return text + (f"; presets with these shapes: {', '.join(matches)}" if matches else "")


def check_torchtitan_checkpoint(path: str | Path) -> Path:
    """The DCP directory to read; a ModelFormatError naming the problem when `path` is not a
    complete DCP checkpoint with torchtitan Llama weights."""
    directory = _require_checkpoint(Path(path))
    _model_tensors(directory)
    return directory


def is_torchtitan_checkpoint(path: str | Path) -> bool:
    """True for a DCP directory (or a torchtitan dump folder with step-N checkpoints) that
    holds torchtitan Llama weights."""
    try:
        check_torchtitan_checkpoint(path)
    except ModelFormatError:
        return False
    return True


# ---- the model's hyperparameters ----------------------------------------------------------


def _args_from_file(file: Path) -> ModelArgs:
    config = artifact.read_json(file)
    if "hidden_size" in config or "model_type" in config:
        return llama_hf.args_from_hf_config(config, file)
    return llama_hf.args_from_meta_params(config, file)


def resolve_model_config(spec: str, summary: dict[str, int] | None = None) -> ModelArgs:
    """ModelArgs named by `--model-config`: a preset, a torchtitan flavor (debugmodel takes
    num_layers and vocab_size from `summary`, the checkpoint's shapes), a directory with
    config.json or params.json (also under original/), or such a file."""
    if spec in TORCHTITAN_FLAVORS:
        flavor = TORCHTITAN_FLAVORS[spec]
        if isinstance(flavor, str):
            return get_preset(flavor)
        if flavor is not _DEBUGMODEL:
            return flavor
        summary = summary or {}
        return flavor.replace(
            num_layers=summary.get("num_layers") or flavor.num_layers,
            vocab_size=summary.get("vocab_size") or flavor.vocab_size,
        )
    if spec in PRESETS:
        return get_preset(spec)
    path = Path(spec)
    if path.is_file():
        return _args_from_file(path)
    for candidate in (
        path / artifact.CONFIG_NAME,
        path / "params.json",
        path / "original" / "params.json",
    ):
        if candidate.is_file():
            return _args_from_file(candidate)
    raise ModelFormatError(
        f"--model-config {spec!r}: not a preset, a torchtitan flavor, or a directory/file with "
        f"config.json or params.json; {_CONFIG_HELP}"
    )


def _check_shapes(directory: Path, model: dict[str, tuple], args: ModelArgs) -> None:
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in Transformer(args).state_dict().items()}
    if args.tie_embeddings:
        expected.pop("output.weight")
        model = {name: spec for name, spec in model.items() if name != "output.weight"}
    summary = _describe(_shape_summary(model))
    for name, shape in expected.items():
        if name in model and model[name][1] != shape:
            raise ModelFormatError(
                f"{directory}: tensor {model[name][0]} has shape {model[name][1]}, the model "
                f"config implies {shape} (checkpoint: {summary})"
            )
    missing, unexpected = sorted(set(expected) - set(model)), sorted(set(model) - set(expected))
    if missing or unexpected:
        raise ModelFormatError(
            f"{directory}: weights disagree with the model config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]} (checkpoint: {summary})"
        )


def _resolve(
    path: Path, model_config: str | ModelArgs | None
) -> tuple[Path, dict[str, tuple], ModelArgs]:
    directory = _require_checkpoint(path)
    model = _model_tensors(directory)
    summary = _shape_summary(model)
    if model_config is None:
        raise ModelFormatError(
            f"{path}: a torchtitan checkpoint does not record num_heads or RoPE settings; "
            f"{_CONFIG_HELP} (checkpoint: {_describe(summary)})"
        )
    if isinstance(model_config, ModelArgs):
        args = model_config
    else:
        args = resolve_model_config(model_config, summary)
    _check_shapes(directory, model, args)
    return directory, model, args


def read_torchtitan_args(path: str | Path, model_config: str | ModelArgs | None) -> ModelArgs:
    """The hyperparameters for a torchtitan checkpoint, checked against its tensor shapes
    (reads only the metadata). `model_config` is required: shapes do not tell num_heads."""
    return _resolve(Path(path), model_config)[2]


# ---- reading the tensors ------------------------------------------------------------------


def read_torchtitan_checkpoint(
    path: str | Path, args: ModelArgs | str | None
) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(ModelArgs, our state dict) of a torchtitan Llama 3 DCP checkpoint, in its stored dtype.

    Args:
        path: a `step-N` directory, or a dump/checkpoint folder holding them (newest complete
            one is read).
        args: the model's hyperparameters, or a `--model-config` string (preset, torchtitan
            flavor, config.json / params.json); checked against the tensor shapes.
    """
    directory, model, args = _resolve(Path(path), args)
    # every model tensor, a tied output too: it is checked to really be the embedding's copy
    state = {key: torch.empty(shape, dtype=dtype) for key, shape, dtype in model.values()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed")
            safe_dcp.load(state, directory, no_dist=True)
    except safe_dcp.DCP_ERRORS as err:  # per-rank failures, gathered by DCP
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelFormatError(
            f"{directory}: cannot read the model tensors ({first_line})"
        ) from None
    ours = {}
    for name, (key, *_) in model.items():
        tensor = state[key]
        if name.endswith("attention.wq.weight"):
            tensor = llama_hf.interleaved_to_half(tensor, args.num_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = llama_hf.interleaved_to_half(tensor, args.num_kv_heads)
        ours[name] = tensor
    if args.tie_embeddings and "output.weight" in ours:
        output = ours.pop("output.weight")
        if not torch.equal(output, ours["tok_embeddings.weight"]):
            raise ModelFormatError(
                f"{directory}: the model config ties the output projection to the embedding, "
                f"but the checkpoint's {model['output.weight'][0]} differs from "
                "tok_embeddings.weight"
            )
    return args, ours
