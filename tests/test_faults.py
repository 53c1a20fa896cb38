"""Checkpoints that try to run code or lie: a crafted pickle in `.metadata` or a per-rank file
runs nothing and is named; bytes changed inside a shard, `.metadata` or a per-rank file fail
their SHA-256 and the run falls back to the checkpoint before, with a warning naming the file.
Each case goes through the library and through the CLI (`lmforge pretrain` resume,
`lmforge export`): one line, exit 2, nothing lost."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge import safe_dcp
from lmforge.train.checkpoint import COMMIT_FILENAME, Checkpointer, CheckpointError
from tests.train_utils import losses, make_shards, pretrain_args, run_inprocess

REPO = Path(__file__).resolve().parents[1]


class _RunsCode:
    """Unpickling this runs `touch MARKER`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def small_state(step: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(8, 4), "train": {"step": step}}


def recommit(checkpoint: Path, name: str) -> None:
    """Rewrite COMMITTED so its size and checksum agree with `name`'s new bytes (what an
    attacker handing over a checkpoint would do)."""
    commit = json.loads((checkpoint / COMMIT_FILENAME).read_text())
    commit["files"][name] = (checkpoint / name).stat().st_size
    commit["sha256"][name] = safe_dcp.sha256_file(checkpoint / name)
    (checkpoint / COMMIT_FILENAME).write_text(json.dumps(commit))


def overwrite_middle(path: Path, num_bytes: int = 4096, seed: int = 0) -> None:
    """Random bytes over the middle of a file, its size unchanged."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - num_bytes // 2)
    end = min(len(data), start + num_bytes)
    data[start:end] = random.Random(seed).randbytes(end - start)
    path.write_bytes(bytes(data))


@pytest.fixture
def two_checkpoints(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    for step in (1, 2):
        checkpointer.save(step, small_state(step, seed=step))
    return (
        tmp_path,
        tmp_path / "checkpoints" / "step-00000001",
        tmp_path / "checkpoints" / "step-00000002",
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data):
    """A pretraining run directory with checkpoints at steps 2 and 4."""
    tokenizer, shards = data
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    extra = ["train.steps=4", "checkpoint.every=2"]
    assert run_inprocess("pretrain", pretrain_args(run_dir, tokenizer, shards, *extra)) == 0
    return run_dir


def lmforge_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmforge", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def assert_one_line_exit_2(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    for needle in needles:
        assert needle in error[0], error[0]


@pytest.mark.parametrize("name", [".metadata", "extra-rank0.pt"])
def test_a_crafted_pickle_runs_nothing_and_is_named(tmp_path, data, trained_run, name):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    newest = run_dir / "checkpoints" / "step-00000004"
    marker = tmp_path / "pwned"
    (newest / name).write_bytes(pickle.dumps(_RunsCode(marker)))
    recommit(newest, name)  # its checksum matches: only the reader stands in the way
    tokenizer, shards = data
    resume = pretrain_args(run_dir, tokenizer, shards, "train.steps=6", "checkpoint.every=2")
    assert_one_line_exit_2(lmforge_cli("pretrain", *resume), str(newest), name)
    export = lmforge_cli("export", str(run_dir), str(tmp_path / "out"))
    if name == ".metadata":
        assert_one_line_exit_2(export, name)
        assert not (tmp_path / "out").exists()
    else:  # export reads the weights only: it never opens the per-rank file
        assert export.returncode == 0, export.stderr[-3000:]
    assert not marker.exists()
    assert (run_dir / "checkpoints" / "step-00000002" / COMMIT_FILENAME).exists()  # untouched


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "extra-rank0.pt"])
def test_changed_bytes_fall_back_to_the_checkpoint_before(two_checkpoints, name, caplog):
    run_dir, older, newest = two_checkpoints
    overwrite_middle(newest / name)
    checkpointer = Checkpointer(run_dir)
    assert checkpointer.latest() == newest  # sizes alone cannot tell
    state = small_state(0, seed=9)
    with caplog.at_level(logging.WARNING):
        assert checkpointer.restore_latest(state) == 1
    assert f"ignoring checkpoint {newest}: file {name} fails its checksum" in caplog.text
    expected = small_state(1, seed=1)["model"].state_dict()
    for key, value in state["model"].state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert checkpointer.last_verified == older
    # kept for inspection, out of the way of step 2 (which the resumed run saves again)
    (aside,) = newest.parent.glob("step-00000002.corrupt-*")
    assert not newest.exists()
    with pytest.raises(CheckpointError, match=f"{name} fails its checksum"):
        checkpointer.load(aside, small_state(0))

    overwrite_middle(older / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be trusted"):
        checkpointer.restore_latest(small_state(0))
    checkpointer.save(1, small_state(1))  # no collision with the steps moved aside
    assert checkpointer.latest() == older


def test_resume_skips_a_corrupt_checkpoint_and_matches_the_uninterrupted_run(
    tmp_path, data, trained_run
):
    tokenizer, shards = data
    args = ["train.steps=6", "checkpoint.every=2"]
    run_inprocess("pretrain", pretrain_args(tmp_path / "reference", tokenizer, shards, *args))
    reference = losses(tmp_path / "reference")

    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    overwrite_middle(run_dir / "checkpoints" / "step-00000004" / "__0_0.distcp")
    (run_dir / "metrics.jsonl").unlink()
    done = lmforge_cli("pretrain", *pretrain_args(run_dir, tokenizer, shards, *args))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step-00000004: file __0_0.distcp fails its checksum" in done.stderr
    resumed = losses(run_dir)
    assert sorted(resumed) == [3, 4, 5, 6]  # from step 2, the newest that verifies
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)
