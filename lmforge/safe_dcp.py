"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP's own reader unpickles `.metadata` with `pickle.load`, and its default load planner reads
non-tensor items with `torch.load(weights_only=False)`: a crafted checkpoint runs arbitrary code
on load. Every DCP checkpoint lmforge reads (its own resume checkpoints, `lmforge export`, a
torchtitan checkpoint from someone else) goes through `load()` here instead:

- `.metadata` is read by an unpickler that builds only DCP's metadata classes, sizes, dtypes
  and plain containers; anything else is refused and named;
- byte items (optimizer hyperparameters, counters) are read with `weights_only=True`.

Also here: the SHA-256 of a file (checkpoint commit markers record one per file).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_NAME = ".metadata"
# What a failed DCP save or load raises: DCP gathers the ranks' errors into a CheckpointException,
# which derives from BaseException, not Exception.
DCP_ERRORS = (Exception, CheckpointException)

_DCP_METADATA_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "StorageMeta",
    "MetadataIndex",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": _DCP_METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnreadableCheckpointError(ValueError):
    """A DCP file that is truncated, corrupt, or asks to build something other than data."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def load_metadata(directory: str | Path) -> Metadata:
    """The DCP metadata of `directory`, built without running code from the file."""
    file = Path(directory) / METADATA_NAME
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except Exception as err:  # truncated file, foreign pickle, refused global
        raise UnreadableCheckpointError(f"{file}: cannot read DCP metadata ({err})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnreadableCheckpointError(
            f"{file}: not DCP metadata (found {type(metadata).__name__})"
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the restricted unpickler for `.metadata`."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = load_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as err:
            raise UnreadableCheckpointError(
                f"item {read_item.dest_index.fqn!r} cannot be read safely ({err})"
            ) from None
        # The parent unpickles without restriction: hand it bytes we wrote from plain data.
        plain = io.BytesIO()
        torch.save(loaded, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


def load(state: dict, directory: str | Path, **kwargs) -> None:
    """`dcp.load(state)` from `directory` through the safe reader and planner (kwargs go to
    dcp.load: process_group, no_dist)."""
    load_metadata(directory)  # a refused or broken file fails here, before DCP logs it
    dcp.load(
        state,
        storage_reader=SafeFileSystemReader(directory),
        planner=SafeLoadPlanner(),
        **kwargs,
    )


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
