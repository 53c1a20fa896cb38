"""Crash-safe, resumable training checkpoints on torch.distributed.checkpoint (DCP).

A checkpoint holds everything needed to resume a run: model and optimizer (through DCP,
sharded and reshardable to another world size), and small per-rank state (data loader
position, RNG streams, LR scheduler, counters) in one `torch.save` file per rank, read back
with `weights_only=True`. Layout of a run directory::

    run_dir/checkpoints/
      step-00000042/                  committed: complete, never written into again
        .metadata  __0_0.distcp  __1_0.distcp    DCP (model + optimizer)
        extra-rank0.pt  extra-rank1.pt           per-rank state
        COMMITTED                                JSON: step, world size, every file, its size
                                                 and SHA-256
      .tmp-step-00000043-5f2c9a1e/    a save in progress, or left by a crash

Crash safety comes from the layout, not from luck: a save writes into a fresh `.tmp-*`
directory; after every rank is done and DCP's coordinator has written `.metadata`, rank 0
writes `COMMITTED` and renames the directory into place (an atomic rename on POSIX). A
SIGKILL at any moment therefore leaves either a complete `step-*` directory or a `.tmp-*` one
that is ignored and later removed; an older checkpoint is only deleted once `keep_last`
(at least 2) newer ones are committed. `latest()` trusts a directory only when its `COMMITTED` marker is
there and every listed file has its recorded size; `restore_latest()` and `load()` also check
every file's SHA-256 (the ranks share the hashing) and fall back past a checkpoint whose bytes
changed, naming the file. Nothing is unpickled without restriction (`lmforge.safe_dcp`).

Typical use in a training loop::

    state = {
        "model": ModelOptimizerState(model, optimizer),
        "scheduler": scheduler,          # anything with state_dict()/load_state_dict()
        "dataloader": loader,
        "rng": RNGState(),
        "train": {"step": 0, "tokens": 0},   # plain dicts are restored in place
    }
    checkpointer = Checkpointer(run_dir, keep_last=2)
    start = checkpointer.restore_latest(state) or 0
    ...
    checkpointer.save(step, state)
    ...
    checkpointer.close()

Resuming with another world size: DCP reshards model and optimizer. RNG streams cannot be
carried over (they stay as seeded, with a warning). A per-rank object that defines
`load_resharded_state_dict(state_dict, *, saved_world_size)` (the data loader) receives rank
0's saved state and re-splits by global position; other per-rank items get their common
value, or rank 0's with a warning when the saved ranks disagreed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from lmforge import safe_dcp
from lmforge.errors import ConfigError, UserError
from lmforge.train.optim import masters_in_params

logger = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"
COMMIT_FILENAME = "COMMITTED"
DCP_METADATA_FILENAME = safe_dcp.METADATA_NAME
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 2  # 2: COMMITTED records a SHA-256 per file; 1 (sizes only) is still read
_RANK_FILE_RE = re.compile(r"^(?:__(\d+)_\d+\.distcp|extra-rank(\d+)\.pt)$")
_STEP_RE = re.compile(r"^step-(\d{8,})$")


class CheckpointError(UserError):
    """A checkpoint that cannot be written or read as asked (exists already, incomplete)."""


def step_dirname(step: int) -> str:
    """`step-00000042`: zero-padded so names sort like steps."""
    return f"step-{step:08d}"


def rank_filename(rank: int) -> str:
    return f"extra-rank{rank}.pt"


# ---- stateful wrappers -------------------------------------------------------------------


class ModelOptimizerState:
    """Model (and optionally its optimizer) as one DCP-stateful item.

    Goes through `get_state_dict` / `set_state_dict`, so plain modules and FSDP2/DTensor-sharded
    ones save their parameters and optimizer state by fully qualified name, which is what lets
    DCP reshard them on load. With `trainable_only`, frozen parameters (a LoRA base model) are
    left out and loading is non-strict.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        trainable_only: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.trainable_only = trainable_only

    def _options(self) -> StateDictOptions:
        return StateDictOptions(
            ignore_frozen_params=self.trainable_only, strict=not self.trainable_only
        )

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self._options())}
        with masters_in_params(self.optimizer):  # bf16 weights save their fp32 masters
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"], options=self._options())
            return
        with masters_in_params(self.optimizer):
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optimizer"],
                options=self._options(),
            )


class RNGState:
    """This process's random number generators: Python `random`, NumPy, torch CPU, and the
    current CUDA device's when CUDA is in use. Saved per rank, since ranks differ."""

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=False)
        state = {
            "python": random.getstate(),
            "numpy": {
                "bit_generator": np_state["bit_generator"],
                # uint32 key as int64: weights_only loading takes tensors, not numpy arrays
                "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                "pos": int(np_state["state"]["pos"]),
                "has_gauss": int(np_state["has_gauss"]),
                "gauss": float(np_state["gauss"]),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np_state = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": np_state["bit_generator"],
                "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
                "has_gauss": np_state["has_gauss"],
                "gauss": np_state["gauss"],
            }
        )
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


# ---- checking a checkpoint directory ------------------------------------------------------


def read_commit(path: str | os.PathLike) -> dict[str, Any] | None:
    """The parsed COMMITTED marker of a checkpoint directory, or None if absent/unreadable."""
    try:
        commit = json.loads((Path(path) / COMMIT_FILENAME).read_text())
    except (OSError, ValueError):
        return None
    return commit if isinstance(commit, dict) else None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not a complete committed checkpoint, or None when it is one."""
    path = Path(path)
    if not (path / COMMIT_FILENAME).is_file():
        return "no COMMITTED marker (its save never finished)"
    commit = read_commit(path)
    if commit is None:
        return "unreadable COMMITTED marker"
    if commit.get("format") not in (1, FORMAT_VERSION):
        return (
            f"checkpoint format {commit.get('format')!r}, this lmforge reads 1 and {FORMAT_VERSION}"
        )
    if commit["format"] >= 2 and set(commit.get("sha256") or ()) != set(commit.get("files") or ()):
        return "COMMITTED marker lacks a checksum for every file"
    files, step, world_size = commit.get("files"), commit.get("step"), commit.get("world_size")
    if not isinstance(files, dict) or not isinstance(step, int) or not isinstance(world_size, int):
        return "COMMITTED marker lacks files/step/world_size"
    match = _STEP_RE.match(path.name)
    if match and int(match.group(1)) != step:
        return f"COMMITTED marker says step {step}"
    expected = [DCP_METADATA_FILENAME] + [rank_filename(r) for r in range(world_size)]
    missing = [name for name in expected if name not in files]
    if missing:
        return f"COMMITTED marker does not list {', '.join(missing)}"
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"file {name} is missing"
        if actual != size:
            return f"file {name} has {actual} bytes where {size} were written"
    return None


def is_committed(path: str | os.PathLike) -> bool:
    return checkpoint_problem(path) is None


def checksum_problem(path: Path, names: list[str], sha256: Mapping[str, str]) -> str | None:
    """The first of `names` whose bytes no longer match the commit's SHA-256, if any."""
    for name in names:
        try:
            actual = safe_dcp.sha256_file(path / name)
        except OSError as exc:
            return f"file {name} cannot be read ({exc.strerror or exc})"
        if actual != sha256[name]:
            return f"file {name} fails its checksum (changed after the checkpoint was written)"
    return None


def _owning_rank(name: str) -> int:
    """The rank that wrote file `name` of a checkpoint (rank 0: .metadata, COMMITTED)."""
    match = _RANK_FILE_RE.match(name)
    return int(match.group(1) or match.group(2)) if match else 0


# ---- small helpers -------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns at every call without torch.distributed; one process is a normal case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_disk_full(err: BaseException, directory: Path) -> bool:
    """ENOSPC anywhere in the chain, or torch's writer failing on a volume with no room left
    (it reports "[enforce fail at inline_container.cc...]" without the errno)."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(directory).free < (1 << 20)
    except OSError:
        return False


def _first_line(err: BaseException) -> str:
    """The first line of an error's message; for DCP's CheckpointException, of the first
    rank's underlying error (its own message is a list of ranks and tracebacks)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = getattr(first, "exception", first)
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, write) -> None:
    with open(path, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())


_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes)


def _check_plain(value: Any, where: str) -> None:
    """Per-rank items are loaded with weights_only=True: only tensors and plain containers."""
    if type(value) in (torch.Tensor, nn.Parameter) or isinstance(value, _PLAIN_LEAVES):
        return
    if type(value) in (list, tuple):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            if not isinstance(key, _PLAIN_LEAVES):
                raise TypeError(f"checkpoint item {where} has a key of type {type(key).__name__}")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"checkpoint item {where} is a {type(value).__module__}.{type(value).__qualname__}; "
        "per-rank state must be made of tensors, None, bools, ints, floats, strs, bytes, "
        "lists, tuples and dicts (it is loaded with weights_only=True)"
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _split_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(items saved through DCP, items saved per rank)."""
    dcp_items, rank_items = {}, {}
    for name, obj in state.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"checkpoint state names must be non-empty strings, got {name!r}")
        if isinstance(obj, ModelOptimizerState):
            dcp_items[name] = obj
        elif isinstance(obj, nn.Module):
            dcp_items[name] = ModelOptimizerState(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            raise TypeError(
                f"checkpoint item {name!r} is a bare optimizer: pass "
                "ModelOptimizerState(model, optimizer) so its state is saved by parameter "
                "name and can be resharded"
            )
        else:
            rank_items[name] = obj
    return dcp_items, rank_items


def _restore_item(state: MutableMapping[str, Any], name: str, value: Any) -> None:
    """Put a loaded per-rank value back: through load_state_dict, or in place for plain
    dicts and lists, else by replacing the entry in `state`."""
    obj = state[name]
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(value)
    elif type(obj) is dict and isinstance(value, dict):
        obj.clear()
        obj.update(value)
    elif type(obj) is list and isinstance(value, list):
        obj[:] = value
    else:
        state[name] = value


@dataclass(frozen=True)
class LoadReport:
    """What `Checkpointer.load` restored."""

    path: Path
    step: int
    saved_world_size: int
    world_size: int
    not_carried_over: tuple[str, ...] = ()  # items left as they were (RNG on a new world size)
    warnings: tuple[str, ...] = ()

    @property
    def resharded(self) -> bool:
        return self.saved_world_size != self.world_size


@dataclass
class _PendingSave:
    step: int
    tmp_dir: Path
    final_dir: Path
    started: float
    future: Any = None  # DCP's Future (async) or None (already written)


# ---- the checkpointer ----------------------------------------------------------------------


class Checkpointer:
    """Saves and restores the checkpoints of one run directory; see the module docstring.

    Every method except `latest()` and `committed()` is collective: all ranks of
    `process_group` (default: the whole world; none when torch.distributed is not initialized)
    must call it together.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        keep_last: int = 2,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if keep_last < 2:
            raise ConfigError(
                f"checkpoint keep_last={keep_last} must be >= 2: the newest checkpoint can be "
                "lost to a crash mid-save, and the one before it is the fallback"
            )
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir / CHECKPOINTS_DIRNAME
        self.keep_last = keep_last
        self.async_save = async_save
        self._distributed = dist.is_available() and dist.is_initialized()
        if async_save and self._distributed and process_group is None:
            # the background writer runs collectives; keep them off the training group
            process_group = dist.new_group(backend="gloo")
        self._group = process_group
        self._pending: _PendingSave | None = None
        self.last_load: LoadReport | None = None
        # the newest checkpoint whose bytes this process wrote and hashed, or verified on load
        self.last_verified: Path | None = None

    # ---- ranks and collectives
    @property
    def rank(self) -> int:
        return dist.get_rank(self._group) if self._distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group) if self._distributed else 1

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self._group)

    def _broadcast(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        if not self._distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self._group, group_src=0)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self._distributed:
            return [value]
        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self._group)
        return values

    # ---- finding checkpoints
    def _step_dirs(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _STEP_RE.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def committed(self) -> list[Path]:
        """All complete committed checkpoints, oldest first."""
        return [path for _, path in self._step_dirs() if checkpoint_problem(path) is None]

    def latest(self) -> Path | None:
        """The newest complete committed checkpoint (by its marker and file sizes; `verify`
        checks the bytes); newer partial ones are skipped with a warning. Local (not
        collective): reads the filesystem only."""
        return next(self._candidates(), None)

    def _candidates(self):
        """Complete committed checkpoints, newest first, warning about the others."""
        pending = self._pending.tmp_dir.name if self._pending else None
        if self.directory.is_dir():
            for path in sorted(self.directory.glob(TMP_PREFIX + "step-*")):
                if path.name != pending:
                    logger.warning(
                        "ignoring partial checkpoint %s: an interrupted save "
                        "(removed at the next save)",
                        path,
                    )
        for _, path in reversed(self._step_dirs()):
            problem = checkpoint_problem(path)
            if problem is None:
                yield path
            else:
                logger.warning("ignoring incomplete checkpoint %s: %s", path, problem)

    def verify(self, path: str | os.PathLike) -> str | None:
        """Why checkpoint `path` cannot be trusted, or None (collective): its marker and file
        sizes, then every file's SHA-256, the ranks sharing the files between them."""
        path = Path(path)
        problem = checkpoint_problem(path)
        if problem is None:
            commit = read_commit(path)
            if "sha256" in commit:
                names = sorted(commit["files"])[self.rank :: self.world_size]
                problem = checksum_problem(path, names, commit["sha256"])
            elif self.rank == 0:
                logger.warning("checkpoint %s has no checksums (format 1): sizes checked", path)
        problems = [p for p in self._gather(problem) if p is not None]
        return problems[0] if problems else None

    # ---- saving
    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Write a checkpoint of `state` for `step` (see the module docstring for what each
        kind of value becomes). With async_save, returns once the tensors are staged in
        memory; the checkpoint is committed by the next `save`, `wait` or `close`."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        self.wait()
        dcp_items, rank_items = _split_state(state)
        rank_states = {}
        for name, obj in rank_items.items():
            value = obj.state_dict() if hasattr(obj, "state_dict") else obj
            _check_plain(value, repr(name))
            rank_states[name] = value

        final_dir = self.directory / step_dirname(step)
        nonce, error = self._broadcast(self._prepare_save(final_dir) if self.rank == 0 else None)
        if error:
            raise CheckpointError(error)
        tmp_dir = self.directory / f"{TMP_PREFIX}{step_dirname(step)}-{nonce}"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        pending = _PendingSave(step, tmp_dir, final_dir, time.monotonic())

        # small per-rank state: written now, whatever the mode, so it matches `step`
        extra = {
            "format": FORMAT_VERSION,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "items": rank_states,
        }
        try:
            _write_durably(tmp_dir / rank_filename(self.rank), lambda f: torch.save(extra, f))
            error = None
        except Exception as err:  # disk full, read-only: every rank must hear of it
            error = self._write_failure(final_dir, err)
        errors = [e for e in self._gather(error) if e]
        if errors:
            self._abandon(tmp_dir)
            raise CheckpointError(errors[0])
        try:
            if self.async_save:
                # stages a copy of the tensors now and writes them in a background thread
                with _quiet_single_process():
                    pending.future = dcp.async_save(
                        dcp_items, checkpoint_id=tmp_dir, process_group=self._group
                    )
                self._pending = pending
            else:
                with _quiet_single_process():
                    dcp.save(dcp_items, checkpoint_id=tmp_dir, process_group=self._group)
                self._commit(pending)
        except CheckpointError:
            raise
        except safe_dcp.DCP_ERRORS as err:  # DCP raised the same on every rank
            self._abandon(tmp_dir)
            raise CheckpointError(self._write_failure(final_dir, err)) from None

    def _write_failure(self, final_dir: Path, err: BaseException) -> str:
        """One line for a failed save, saying what is still safe."""
        reason = _first_line(err)
        if _is_disk_full(err, self.directory):
            reason = f"no space left on the device of {self.directory}"
        kept = self.latest()
        return f"could not write checkpoint {final_dir}: {reason}; " + (
            f"the previous checkpoint {kept} is intact" if kept else "no earlier checkpoint"
        )

    def _abandon(self, tmp_dir: Path) -> None:
        """Remove a failed save's partial files (space a full disk needs back)."""
        if self.rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    def _prepare_save(self, final_dir: Path) -> tuple[str, str | None]:
        """Rank 0: a nonce for the temporary directory, or an error when `final_dir` is taken."""
        nonce = uuid.uuid4().hex[:8]
        if final_dir.exists():
            problem = checkpoint_problem(final_dir)
            if problem is None:
                return nonce, (
                    f"checkpoint {final_dir} exists and is committed; it is never overwritten "
                    "(resume from it, or use another run directory)"
                )
            # not ours to trust and in the way of the rename: move aside; removed with the
            # stale temporaries after this save commits
            aside = final_dir.with_name(f"{TMP_PREFIX}invalid-{final_dir.name}-{nonce}")
            logger.warning(
                "moving incomplete checkpoint %s (%s) aside to %s", final_dir, problem, aside
            )
            try:
                os.rename(final_dir, aside)
            except OSError as exc:
                return nonce, f"cannot move incomplete checkpoint {final_dir} aside: {exc}"
        return nonce, None

    def wait(self) -> None:
        """Finish a pending async save and commit it (collective; no-op when none)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self._commit(pending)

    def _commit(self, pending: _PendingSave) -> None:
        if pending.future is not None:
            try:
                pending.future.result()  # raises if the background write failed
            except safe_dcp.DCP_ERRORS as err:
                self._abandon(pending.tmp_dir)
                raise CheckpointError(self._write_failure(pending.final_dir, err)) from None
        # every rank's shards and per-rank file are written; DCP's coordinator has written
        # .metadata before any rank's save returned
        self._barrier()
        # each rank hashes the files it wrote (read back from the page cache)
        own = sorted(p.name for p in pending.tmp_dir.iterdir() if p.is_file())
        own = [name for name in own if _owning_rank(name) % self.world_size == self.rank]
        digests = {name: safe_dcp.sha256_file(pending.tmp_dir / name) for name in own}
        sha256 = {k: v for part in self._gather(digests) for k, v in part.items()}
        error = None
        if self.rank == 0:
            try:
                self._commit_on_rank0(pending, sha256)
            except (OSError, AssertionError) as exc:  # tell the other ranks instead of hanging
                error = f"could not commit checkpoint {pending.final_dir}: {exc}"
        error = self._broadcast(error)
        if error:
            raise CheckpointError(error)
        self.last_verified = pending.final_dir

    def _commit_on_rank0(self, pending: _PendingSave, sha256: dict[str, str]) -> None:
        tmp_dir, final_dir = pending.tmp_dir, pending.final_dir
        files = {p.name: p.stat().st_size for p in sorted(tmp_dir.iterdir()) if p.is_file()}
        unhashed = sorted(set(files) - set(sha256))
        assert not unhashed, f"{tmp_dir}: no rank hashed {unhashed}"
        expected = [DCP_METADATA_FILENAME] + [rank_filename(r) for r in range(self.world_size)]
        missing = [name for name in expected if name not in files]
        assert not missing, f"{tmp_dir} lacks {missing} after every rank finished saving"
        commit = {
            "format": FORMAT_VERSION,
            "step": pending.step,
            "world_size": self.world_size,
            "time": time.time(),
            "files": files,
            "sha256": {name: sha256[name] for name in files},
        }
        _write_durably(
            tmp_dir / COMMIT_FILENAME, lambda f: f.write(json.dumps(commit, indent=1).encode())
        )
        _fsync_dir(tmp_dir)
        if final_dir.exists():
            raise FileExistsError(f"{final_dir} appeared during the save; not overwriting it")
        os.rename(tmp_dir, final_dir)  # the commit point
        _fsync_dir(self.directory)
        logger.info(
            "checkpoint %s committed: %.1f MB in %.1f s",
            final_dir,
            sum(files.values()) / 1e6,
            time.monotonic() - pending.started,
        )
        self._prune()

    def _prune(self) -> None:
        """Rank 0: keep the newest `keep_last` committed checkpoints; remove leftovers of
        interrupted saves. Failures only warn: the new checkpoint is already safe."""
        doomed = self.committed()[: -self.keep_last]
        doomed += [p for p in self.directory.glob(TMP_PREFIX + "*") if p.is_dir()]
        for path in doomed:
            try:
                if not path.name.startswith(TMP_PREFIX):
                    # rename first, so a crash mid-delete leaves a .tmp-* and no half checkpoint
                    aside = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{uuid.uuid4().hex[:8]}")
                    os.rename(path, aside)
                    path = aside
                shutil.rmtree(path)
            except OSError as exc:
                logger.warning("could not remove old checkpoint %s: %s", path, exc)

    def close(self) -> None:
        """Commit any pending async save (collective)."""
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- loading
    def load(
        self, path: str | os.PathLike, state: MutableMapping[str, Any], *, verified: bool = False
    ) -> LoadReport:
        """Restore `state` in place from the checkpoint at `path` (collective), after checking
        its bytes (unless `verified`). Only the items named in `state` are read; each must be
        in the checkpoint."""
        path = Path(path)
        problem = None if verified else self.verify(path)
        if problem is not None:
            raise CheckpointError(f"cannot load checkpoint {path}: {problem}")
        commit = read_commit(path)
        saved_world_size = commit["world_size"]
        dcp_items, rank_items = _split_state(state)
        if dcp_items:
            try:
                with _quiet_single_process():
                    safe_dcp.load(dcp_items, path, process_group=self._group)
            except safe_dcp.DCP_ERRORS as err:  # every rank's failure, gathered
                raise CheckpointError(
                    f"cannot load checkpoint {path} into this run: {_first_line(err)}"
                ) from None

        messages: list[str] = []
        not_carried: list[str] = []

        def warn(message: str) -> None:
            messages.append(message)
            if self.rank == 0:
                logger.warning(message)

        saved_ranks: dict[int, dict[str, Any]] = {}

        def saved(rank: int) -> dict[str, Any]:
            if rank not in saved_ranks:
                file = path / rank_filename(rank)
                try:
                    extra = torch.load(file, map_location="cpu", weights_only=True)
                    saved_ranks[rank] = extra["items"]
                except Exception as err:  # refused global, truncation, not a dict
                    raise CheckpointError(f"cannot read {file}: {_first_line(err)}") from None
            return saved_ranks[rank]

        resharded = saved_world_size != self.world_size
        for name, obj in rank_items.items():
            own = saved(self.rank if not resharded else 0)
            if name not in own:
                raise CheckpointError(
                    f"checkpoint {path} has no item {name!r} (it has: {', '.join(sorted(own))})"
                )
            if not resharded:
                _restore_item(state, name, own[name])
            elif isinstance(obj, RNGState):
                not_carried.append(name)
                warn(
                    f"checkpoint {path.name} was saved by {saved_world_size} ranks, this run has "
                    f"{self.world_size}: RNG streams ({name!r}) cannot be carried over; each rank "
                    "keeps its freshly seeded generators, so random draws (dropout, sampling) "
                    "will differ from an uninterrupted run"
                )
            elif hasattr(obj, "load_resharded_state_dict"):
                obj.load_resharded_state_dict(own[name], saved_world_size=saved_world_size)
                warn(
                    f"{name!r}: rank 0's saved state (of {saved_world_size} ranks) was handed to "
                    f"{type(obj).__name__}.load_resharded_state_dict to re-split over "
                    f"{self.world_size} ranks"
                )
            elif all(_equal(saved(r)[name], own[name]) for r in range(1, saved_world_size)):
                _restore_item(state, name, own[name])  # same on every saved rank: carries over
            else:
                _restore_item(state, name, own[name])
                warn(
                    f"{name!r} differed across the {saved_world_size} saved ranks and "
                    f"{type(obj).__name__} cannot re-split it (no load_resharded_state_dict); "
                    f"rank 0's saved value is used on all {self.world_size} ranks"
                )

        report = LoadReport(
            path=path,
            step=commit["step"],
            saved_world_size=saved_world_size,
            world_size=self.world_size,
            not_carried_over=tuple(not_carried),
            warnings=tuple(messages),
        )
        self.last_load = report
        self.last_verified = path
        if self.rank == 0:
            logger.info("restored checkpoint %s (step %d)", path, report.step)
        return report

    def restore_latest(self, state: MutableMapping[str, Any]) -> int | None:
        """Load the newest checkpoint that verifies into `state` (collective); returns its
        step, or None when the run directory has none. A checkpoint that fails its checks is
        skipped with a warning naming the file; if none passes, nothing is loaded and a
        CheckpointError says why (a fresh start would collide with the committed steps)."""
        candidates = [str(p) for p in self._candidates()] if self.rank == 0 else None
        problems = []
        for path in map(Path, self._broadcast(candidates)):
            problem = self.verify(path)
            if problem is None:
                return self.load(path, state, verified=True).step
            problems.append(f"{path.name}: {problem}")
            if self.rank == 0:
                aside = self._move_aside(path, "corrupt")
                logger.warning("ignoring checkpoint %s: %s (kept as %s)", path, problem, aside)
        if problems:
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be trusted ({'; '.join(problems)}); "
                "move them away to start this run over"
            )
        return None

    def _move_aside(self, path: Path, why: str) -> Path:
        """Rank 0: rename a checkpoint that failed its checks out of the way of the step it
        held (a resumed run saves that step again), keeping its files for inspection."""
        aside = path.with_name(f"{path.name}.{why}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, aside)
        except OSError as exc:
            logger.warning("could not move %s aside: %s", path, exc)
            return path
        return aside
