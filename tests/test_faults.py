"""Checkpoints that try to run code or lie: a crafted pickle in `.metadata` or a per-rank file
runs nothing and is named; bytes changed inside a shard, `.metadata` or a per-rank file fail
their SHA-256 and the run falls back to the checkpoint before, with a warning naming the file.
Each case goes through the library and through the CLI (`lmforge pretrain` resume,
`lmforge export`): one line, exit 2, nothing lost."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmforge import safe_dcp
from lmforge.train.checkpoint import COMMIT_FILENAME, Checkpointer, CheckpointError
from tests.train_utils import losses, pretrain_args, run_inprocess

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


# ---- inputs that used to fail later, or with a traceback ------------------------------------


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["optim.betas=[0.9,1.5]"], "optim.betas[1] = 1.5"),
        (["train.seed=-1"], "train.seed = -1"),
        (["parallel.cpu_offload=true"], "parallel.cpu_offload"),
        (["model.overrides.rope_theta=0"], "rope_theta=0 must be > 0"),
        (["model.overrides.norm_eps=0"], "norm_eps=0 must be > 0"),
        (["model.overrides.max_seq_len=16"], "exceeds the model's max_seq_len 16"),
    ],
)
def test_bad_values_are_refused_before_training(tmp_path, data, capsys, extra, needle):
    tokenizer, shards = data
    run_dir = tmp_path / "run"
    assert run_inprocess("pretrain", pretrain_args(run_dir, tokenizer, shards, *extra)) == 2
    (error,) = _error_lines(capsys)
    assert needle in error
    assert not (run_dir / "checkpoints").exists()


def test_run_dir_naming_a_file_and_a_yaml_value_under_an_override(tmp_path, data, capsys):
    tokenizer, shards = data
    (tmp_path / "file").write_text("x")
    assert run_inprocess("pretrain", pretrain_args(tmp_path / "file", tokenizer, shards)) == 2
    assert "is a file" in _error_lines(capsys)[0]
    (tmp_path / "job.yaml").write_text("train: 5\n")
    args = [
        "--config",
        str(tmp_path / "job.yaml"),
        *pretrain_args(tmp_path / "r", tokenizer, shards),
    ]
    assert run_inprocess("pretrain", args) == 2
    error = _error_lines(capsys)[0]
    assert "job.yaml:1) is a value, not a section: it cannot take train." in error


def test_resume_with_another_shape_or_fewer_steps_keeps_the_run(
    tmp_path, data, trained_run, capsys
):
    tokenizer, shards = data
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    job = (run_dir / "job.toml").read_text()
    wider = pretrain_args(run_dir, tokenizer, shards, "model.overrides.dim=128", "train.steps=6")
    assert run_inprocess("pretrain", wider) == 2
    assert "another model shape (dim 64 -> 128)" in _error_lines(capsys)[0]
    assert (run_dir / "job.toml").read_text() == job  # the run's own config survives
    fewer = pretrain_args(run_dir, tokenizer, shards, "train.steps=3")
    assert run_inprocess("pretrain", fewer) == 2
    assert "train.steps = 3 is below step 4" in _error_lines(capsys)[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000004",
    ]


def test_config_json_with_a_wrong_type_is_one_line(tmp_path, capsys):
    from lmforge.cli import main as cli_main

    config = {"model_type": "llama", "hidden_size": "big", "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 300}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli_main(["model", "info", str(tmp_path)]) == 2
    (error,) = _error_lines(capsys)
    assert "config.json" in error and "wrong type" in error


def test_empty_dpo_responses_are_bad_rows():
    from lmforge.data.preference import PreferenceDataSection, preference_pair
    from lmforge.data.sft import RowProblem

    for chosen, rejected in (("", "no"), ("yes", "  ")):
        row = {"prompt": "Is it?", "chosen": chosen, "rejected": rejected}
        with pytest.raises(RowProblem, match="is empty"):
            preference_pair(row, PreferenceDataSection())


# ---- a full disk and read-only directories (tmpfs mounts: root only, skipped elsewhere) ------


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_disk_full_during_a_save_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path, data, trained_run, capsys
):
    tokenizer, shards = data
    checkpoint = _bytes_under(trained_run / "checkpoints" / "step-00000002")
    # room for the run's small files and one checkpoint, not for a second one beside it
    size = _bytes_under(trained_run / "model") + checkpoint * 3 // 2 + (256 << 10)
    with tmpfs(tmp_path / "small", f"size={size}") as small:
        run_dir = small / "run"
        args = pretrain_args(run_dir, tokenizer, shards, "train.steps=4", "checkpoint.every=2")
        assert run_inprocess("pretrain", args) == 2
        (error,) = _error_lines(capsys)
        assert "could not write checkpoint" in error and "step-00000004" in error, error
        assert "no space left" in error and "step-00000002 is intact" in error, error
        kept = run_dir / "checkpoints" / "step-00000002"
        assert Checkpointer(run_dir).verify(kept) is None
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the partial save is gone


def test_read_only_run_dir_and_prepare_out(tmp_path, data, capsys):
    tokenizer, shards = data
    with tmpfs(tmp_path / "ro", "ro,size=1m") as read_only:
        assert run_inprocess("pretrain", pretrain_args(read_only / "run", tokenizer, shards)) == 2
        assert "cannot write to run_dir" in _error_lines(capsys)[0]
        prepare = ["--input", str(shards.parent / "corpus.txt"), "--tokenizer", str(tokenizer)]
        assert run_inprocess("prepare", [*prepare, "--out", str(read_only / "shards")]) == 2
        assert "Read-only file system" in _error_lines(capsys)[0]


# ---- processes ----------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has exited: only its exit status is left


def test_killed_prepare_leaves_no_workers_and_a_rerun_finishes_then_skips(tmp_path, data):
    from tests.train_utils import descendants, write_corpus

    tokenizer, _ = data
    corpus = write_corpus(tmp_path / "corpus.txt", num_docs=300_000)
    out = tmp_path / "shards"
    command = [sys.executable, "-m", "lmforge", "prepare", "--input", str(corpus)]
    command += ["--tokenizer", str(tokenizer), "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(workers := descendants(proc.pid)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "no workers started"
        time.sleep(0.05)
    proc.kill()  # as soon as the workers exist: whatever the machine's speed, mid-run
    proc.wait()
    deadline = time.monotonic() + 15
    while not all(_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their parent"
        time.sleep(0.05)
    assert list(tmp_path.glob(".shards.partial-*")) and not out.exists()

    first = lmforge_cli(*command[3:])
    assert first.returncode == 0, first.stderr[-2000:]
    assert not list(tmp_path.glob(".shards.partial-*"))  # the killed run's leftovers went
    again = lmforge_cli(*command[3:])
    assert again.returncode == 0 and "already prepared" in again.stderr, again.stderr[-2000:]
