"""Model artifacts: the directory every stage reads and writes.

An artifact is a Hugging Face model directory (config.json, safetensors weights, tokenizer
files, generation_config.json) plus `lmforge.json`, the lineage record: which stage made it,
from which parent (path and hash), with what config and metrics, by which code version.
This module reads and writes the files; `lmforge.api` turns them into models.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmforge.errors import ModelFormatError, OutputError, write_error

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
LINEAGE_NAME = "lmforge.json"
GENERATION_CONFIG_NAME = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFormatError(f"{path}: not valid JSON ({err})") from None


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory, from its index when there is one."""
    index_path = directory / INDEX_NAME
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFormatError(f"{index_path}: no 'weight_map' in the index")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelFormatError(
                f"{index_path}: lists shard(s) that are absent: {', '.join(missing)}"
            )
        return files
    single = directory / WEIGHTS_NAME
    if single.exists():
        return [single]
    raise ModelFormatError(f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME}")


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors model directory, on the CPU."""
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError) as err:
            raise ModelFormatError(f"{file}: cannot read safetensors ({err})") from None
    return state


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or an int of bytes -> bytes."""
    if isinstance(text, int):
        return text
    units = {"KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
    clean = text.strip().upper()
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if clean.endswith(unit):
            return int(float(clean[: -len(unit)]) * scale)
    if clean.endswith("B"):
        clean = clean[:-1]
    try:
        return int(clean)
    except ValueError:
        raise ModelFormatError(
            f"size {text!r} is not understood; use bytes or a unit: KB, MB, GB, KiB, MiB, GiB"
        ) from None


def write_safetensors(
    state: dict[str, torch.Tensor],
    directory: Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write tensors as one file, or as shards of at most `max_shard_bytes` with an index
    (a tensor larger than the limit gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        shard_bytes += size
    metadata = {"format": "pt"}
    if len(shards) == 1:
        path = directory / WEIGHTS_NAME
        save_file(shards[0], path, metadata=metadata)
        return [path]
    paths, weight_map = [], {}
    for number, shard in enumerate(shards, start=1):
        path = directory / f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path, metadata=metadata)
        paths.append(path)
        weight_map.update(dict.fromkeys(shard, path.name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    write_json(
        directory / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    return paths


def directory_hash(directory: Path) -> str:
    """sha256 over config.json and the weights (and adapter) files, in name order."""
    digest = hashlib.sha256()
    names = [CONFIG_NAME, INDEX_NAME, "adapter_config.json"]
    files = [directory / n for n in names if (directory / n).exists()]
    files += sorted(directory.glob("*.safetensors"))
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def artifact_hash(directory: Path) -> str:
    """The artifact's content hash, taken from lmforge.json when recorded there."""
    lineage_path = directory / LINEAGE_NAME
    if lineage_path.exists():
        recorded = read_json(lineage_path).get("hash")
        if recorded:
            return recorded
    return directory_hash(directory)


def code_version() -> str:
    from lmforge.version import __version__

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{__version__}+{commit}" if commit else __version__


def lineage_record(
    *,
    stage: str,
    parent: str | Path | None,
    config: dict | None = None,
    metrics: dict | None = None,
) -> dict:
    """The lmforge.json content, less the hash (added once the files are written)."""
    parent_info = None
    if parent is not None:
        parent_path = Path(parent)
        parent_info = {"source": str(parent)}
        if parent_path.is_dir() and (parent_path / CONFIG_NAME).exists():
            parent_info["hash"] = artifact_hash(parent_path)
    return {
        "format_version": 1,
        "stage": stage,
        "parent": parent_info,
        "config": config or {},
        "metrics": metrics or {},
        "code_version": code_version(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# Training stages whose every sample is rendered with the chat template (SFT's conversations,
# DPO's prompt + response pairs): what they make answers in that template. A GRPO stage may
# train on plain-text prompts, so it, like the stages that only carry weights on (quantize,
# merge, convert, export), leaves the answer to the model it started from.
CHAT_TRAINING_STAGES = frozenset({"sft", "dpo"})
MAX_LINEAGE_DEPTH = 64  # parents followed before a lineage counts as a loop


def chat_tuned(directory: str | Path) -> bool | None:
    """What an artifact's lineage (its lmforge.json, then its parents') says of chat: True when
    the nearest stage that trained it on its own kind of data is SFT or DPO, False when it is
    pretraining, None when the record ends first (a Hugging Face or Meta model, a preset, an
    export's checkpoint, a parent that is gone or unreadable).

    A parent recorded by a relative path (a pipeline's `runs/<name>/<stage>/...`, relative to
    where the pipeline ran) is looked for from the working directory, then from each directory
    above the artifact."""
    path = Path(directory)
    for _ in range(MAX_LINEAGE_DEPTH):
        try:
            lineage = json.loads((path / LINEAGE_NAME).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(lineage, dict):
            return None
        stage = lineage.get("stage")
        if stage in CHAT_TRAINING_STAGES:
            return True
        if stage == "pretrain":
            return False
        source = (lineage.get("parent") or {}).get("source")
        if not isinstance(source, str) or not source:
            return None
        parent = Path(source)
        if not parent.is_absolute() and not (parent / LINEAGE_NAME).is_file():
            found = [d / parent for d in path.resolve().parents if (d / parent).is_dir()]
            parent = found[0] if found else parent
        path = parent
    return None


# The entries an artifact directory holds when lmforge wrote it (tokenizer files, PEFT
# adapter, Meta's original tokenizer): what `--overwrite` may replace without losing a file
# the user put there.
ARTIFACT_ENTRIES = (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    LINEAGE_NAME,
    INDEX_NAME,
    "*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "adapter_config.json",
    "original",
    "adapter",
)


def _within(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def check_output(
    out: str | Path, *, inputs: Iterable[str | Path] = (), overwrite: bool = False
) -> None:
    """Refuse (one line, exit 2) an output directory whose writing would lose something:
    one of the command's `inputs` or a directory that holds or is inside one; a file; a
    directory that is neither empty nor an lmforge artifact; an artifact that holds entries
    lmforge does not write; an artifact without `overwrite`."""
    out = Path(out)
    resolved = out.resolve()
    for source in inputs:
        source_path = Path(source)
        if not source_path.exists():
            continue  # a preset or hub id: nothing on this disk to lose
        source_path = source_path.resolve()
        if _within(resolved, source_path) or _within(source_path, resolved):
            how = (
                "is"
                if resolved == source_path
                else ("is inside" if _within(resolved, source_path) else "holds")
            )
            raise OutputError(
                f"OUT {out} {how} the input {source}: writing it would destroy what the "
                "command reads; choose another output directory"
            )
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"OUT {out} is a file; name a directory (new, empty or an artifact)")
    entries = sorted(entry.name for entry in out.iterdir())
    if not entries:
        return
    if LINEAGE_NAME not in entries:
        raise OutputError(
            f"OUT {out} is not empty and not an lmforge artifact (it holds "
            f"{_listing(entries)}); write to a new or empty directory"
        )
    foreign = [e for e in entries if not any(fnmatch(e, p) for p in ARTIFACT_ENTRIES)]
    if foreign:
        raise OutputError(
            f"OUT {out} is an artifact that also holds files lmforge did not write "
            f"({_listing(foreign)}); move them out first"
        )
    if not overwrite:
        raise OutputError(f"OUT {out} is an artifact already; pass --overwrite to replace it")


def _listing(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@contextmanager
def atomic_directory(final: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `final` by rename, so a
    crash never leaves a half-written artifact at the final path, and an artifact replaced
    (`overwrite`) stays whole until the new one is complete. `final` is checked first
    (`check_output`); a write that fails for the user's reasons is one `OutputError`."""
    final = Path(final)
    check_output(final, overwrite=overwrite)
    if final.is_dir() and os.path.ismount(final):
        raise OutputError(
            f"OUT {final} is a mount point, which cannot be replaced by a finished directory "
            "(lmforge's atomic write); name a directory inside it"
        )
    staging = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        yield staging
        make_readable(staging)
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, final)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(staging, ignore_errors=True)
        error = write_error(err, final)
        if error is None:
            raise
        raise error from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def make_readable(directory: Path) -> None:
    """Give every file the mode the umask allows (safetensors writes its files 0600: another
    user, or a serving container, could not read the weights)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)
