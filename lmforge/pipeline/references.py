"""What a stage reads and how its inputs are fingerprinted: `${stage}` / `${data.NAME}`
references in stage settings, the files outside the run directory a stage names, and content
fingerprints of files, directories and artifacts (what decides that a stage is up to date)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.errors import ConfigError, StageOrderError

if TYPE_CHECKING:
    from lmforge.pipeline.schema import DataSetSection

# Files bigger than this are fingerprinted by size and mtime instead of content.
CONTENT_HASH_MAX_BYTES = 64 * 1024**2
_REFERENCE = re.compile(r"\$\{([^}]*)\}")


class References:
    """Replaces `${stage}` and `${data.NAME}` in settings, collecting the dependencies."""

    def __init__(self, outputs: dict[str, Path], data: dict[str, DataSetSection], where: str):
        self.outputs, self.data, self.where = outputs, data, where
        self.depends: set[str] = set()
        self.external: set[str] = set()

    def substitute(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.substitute(v) for k, v in value.items()}
        if isinstance(value, list):
            out: list = []
            for item in value:
                new = self.substitute(item)
                # "${data.x}" naming a list of files splices it into the list
                if isinstance(item, str) and isinstance(new, list):
                    out.extend(new)
                else:
                    out.append(new)
            return out
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _REFERENCE.fullmatch(value)
        if whole:
            return self._lookup(whole.group(1))

        def one(match: re.Match) -> str:
            found = self._lookup(match.group(1))
            if isinstance(found, list):
                raise ConfigError(
                    f"{self.where}: ${{{match.group(1)}}} is a list of paths; "
                    "use it as a whole value"
                )
            return found

        return _REFERENCE.sub(one, value)

    def _lookup(self, key: str) -> str | list[str]:
        if key.startswith("data."):
            name = key.removeprefix("data.")
            if name not in self.data:
                raise ConfigError(
                    f"{self.where}: ${{{key}}}: no data set {name!r}; data sets: "
                    f"{', '.join(self.data) or '(none)'}"
                )
            path = self.data[name].path
            values = [self.substitute(p) for p in ([path] if isinstance(path, str) else path)]
            return values[0] if isinstance(path, str) else values
        if key in self.outputs:
            self.depends.add(key)
            return str(self.outputs[key])
        raise StageOrderError(  # a stage that failed to resolve has said why already
            f"{self.where}: ${{{key}}} names no earlier stage and no data set (stages before "
            f"it: {', '.join(self.outputs) or '(none)'}; data sets: ${{data.NAME}})",
            stage=key,
        )


def external_inputs(config: Any, workdir: Path, run_dir: Path) -> list[str]:
    """Setting values that name existing files or directories outside the run directory:
    inputs whose content decides whether the stage is up to date."""
    found: set[str] = set()
    runs = (workdir / run_dir).resolve()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str) and value and "\n" not in value and len(value) < 4096:
            path = Path(value)
            full = path if path.is_absolute() else workdir / path
            try:
                exists = full.exists()
                inside = full.resolve().is_relative_to(runs)  # a stage's output: a dependency
            except (OSError, ValueError):
                return
            if exists and not inside and full.resolve() != workdir:
                found.add(value)

    walk(config)
    return sorted(found)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(path: Path) -> str | None:
    """A content fingerprint of a file or directory (None when absent). An artifact's is its
    recorded hash; files above 64 MiB count by size and modification time."""
    from lmforge.artifact import LINEAGE_NAME, artifact_hash

    if not path.exists():
        return None
    if path.is_dir() and (path / LINEAGE_NAME).exists():
        return artifact_hash(path)
    if path.is_file():
        return _file_fingerprint(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path)
        if any(part.startswith(".") for part in relative.parts):
            continue
        digest.update(f"{relative.as_posix()}:{_file_fingerprint(file)}\n".encode())
    return digest.hexdigest()


def _file_fingerprint(path: Path) -> str:
    stat = path.stat()
    if stat.st_size > CONTENT_HASH_MAX_BYTES:
        return f"stat:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def directory_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def combined_hash(inputs: Mapping[str, str | None]) -> str:
    return sha256_text(json.dumps(dict(sorted(inputs.items())), separators=(",", ":")))
