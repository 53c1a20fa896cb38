"""Nothing a user owns is lost. An OUT that holds the user's files, or is (inside, around) an
input, is refused before any work by every command that writes an artifact; an artifact is
replaced only with --overwrite, and atomically; a write that fails (disk full, read-only, a
mount point) is one line and leaves no staging behind; written files are readable by others
(0644 under umask 022); one writer at a time holds a run directory, and a killed one holds
nothing; SIGTERM to `lmforge run` stops its stage (which saves) and leaves no process; pipeline
files with mistakes name the first cause, not its consequences."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lmforge
from lmforge.api import LoadedModel, build_model
from lmforge.cli import main as cli_main
from lmforge.errors import ConfigError
from lmforge.locks import DirectoryInUseError, one_writer
from lmforge.pipeline import load_pipeline, pipeline_status, read_manifest, write_manifest
from tests.test_faults import _error_lines, tmpfs
from tests.train_utils import SMALL_MODEL, descendants, pretrain_args, run_inprocess, small_args

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A float32 artifact of the small model."""
    loaded = LoadedModel(build_model(small_args(), seed=0), None, small_args(), "small")
    return lmforge.save(loaded, tmp_path_factory.mktemp("owned") / "source", stage="test")


def _writers(source: Path, run_dir: Path, out: Path) -> dict[str, list[str]]:
    """Every command that writes an artifact to OUT, as its command line."""
    return {
        "convert": ["convert", str(source), str(out)],
        "quantize": ["quantize", str(source), str(out), "--scheme", "int8-wo"],
        "export": ["export", str(run_dir), str(out)],
        # the adapter is never read: OUT is refused first
        "merge": ["merge", str(source), str(run_dir), str(out)],
    }


@pytest.mark.parametrize("command", ["convert", "quantize", "export", "merge"])
def test_an_out_holding_the_users_files_is_refused_by_every_writer(
    tmp_path, source, trained_run, command, capsys
):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "config.json").write_text("{}")  # looks like a model, is not an lmforge artifact
    assert cli_main(_writers(source, trained_run, out)[command]) == 2
    (error,) = _error_lines(capsys)
    assert "not empty and not an lmforge artifact" in error and "notes.txt" in error, error
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    assert (out / "notes.txt").read_text() == "my notes"
    assert not list(tmp_path.glob(".mine.*"))


def test_an_out_that_is_inside_or_around_an_input_is_refused(tmp_path, source, capsys):
    before = sorted(p.name for p in source.iterdir())
    cases = {
        str(source): f"OUT {source} is the input",
        str(source / "q"): "is inside the input",
        str(source.parent): "holds the input",
    }
    for out, needle in cases.items():
        assert cli_main(["quantize", str(source), out, "--scheme", "int8-wo"]) == 2
        (error,) = _error_lines(capsys)
        assert needle in error, error
    assert sorted(p.name for p in source.iterdir()) == before
    assert lmforge.load(source).config == small_args()


def test_an_artifact_is_replaced_only_with_overwrite_and_is_readable(tmp_path, source, capsys):
    out = tmp_path / "out"
    old_umask = os.umask(0o022)
    try:
        assert cli_main(["convert", str(source), str(out), "--dtype", "bfloat16"]) == 0
        assert cli_main(["convert", str(source), str(out)]) == 2
        assert "is an artifact already; pass --overwrite" in _error_lines(capsys)[0]
        assert lmforge.load(out).model.tok_embeddings.weight.dtype == torch.bfloat16  # kept
        assert cli_main(["convert", str(source), str(out), "--overwrite"]) == 0
    finally:
        os.umask(old_umask)
    assert lmforge.load(out).model.tok_embeddings.weight.dtype == torch.float32
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    (out / "notes.txt").write_text("mine")  # an artifact the user has added a file to
    assert cli_main(["convert", str(source), str(out), "--overwrite"]) == 2
    assert "also holds files lmforge did not write (notes.txt)" in _error_lines(capsys)[0]
    assert not list(tmp_path.glob(".out.*"))


def test_a_full_read_only_or_mounted_out_is_one_line_and_leaves_no_staging(
    tmp_path, source, capsys
):
    with tmpfs(tmp_path / "small", "size=64k") as small:
        assert cli_main(["convert", str(source), str(small / "out")]) == 2
        (error,) = _error_lines(capsys)
        assert error.startswith("error: cannot write") and "No space left" in error, error
        assert list(small.iterdir()) == []  # the partial artifact went with its staging
        assert cli_main(["quantize", str(source), str(small), "--scheme", "int8-wo"]) == 2
        assert "is a mount point" in _error_lines(capsys)[0]
    with tmpfs(tmp_path / "ro", "ro,size=1m") as read_only:
        assert cli_main(["convert", str(source), str(read_only / "out")]) == 2
        assert "Read-only file system" in _error_lines(capsys)[0]


# ---- one writer a run directory -----------------------------------------------------------

HOLD = """
import sys, time
from lmforge.locks import one_writer
with one_writer(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_writer_is_refused_and_a_killed_one_holds_nothing(tmp_path, data, capsys):
    tokenizer, shards = data
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        args = pretrain_args(run_dir, tokenizer, shards, "train.steps=2")
        assert run_inprocess("pretrain", args) == 2
        (error,) = _error_lines(capsys)
        assert f"is in use by pid {holder.pid} on {socket.gethostname()}" in error, error
        assert not (run_dir / "metrics.jsonl").exists()
    finally:
        holder.kill()  # SIGKILL: no cleanup ran, the lock file stays
        holder.wait()
    assert (run_dir / ".lmforge.lock").exists()
    assert run_inprocess("pretrain", args) == 0
    assert (run_dir / "artifact" / "model.safetensors").exists()


def test_a_resumed_run_says_from_where(tmp_path, data, trained_run, capsys):
    import shutil

    tokenizer, shards = data
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    args = pretrain_args(run_dir, tokenizer, shards, "train.steps=5", "checkpoint.every=2")
    assert run_inprocess("pretrain", args) == 0
    err = capsys.readouterr().err
    assert f"resumed from step 4 ({run_dir / 'checkpoints' / 'step-00000004'})" in err, err


PIPELINE = """
[pipeline]
name = "p"
report = false

[stages.pre]
kind = "pretrain"
data.shards = "{shards}"
data.seq_len = 32
model.tokenizer = "{tokenizer}"
train.micro_batch_size = 4
train.steps = 100000
checkpoint.every = 0
metrics.log_every = 1
metrics.tensorboard = false
{model}
"""


def _pipeline(tmp_path: Path, data) -> Path:
    tokenizer, shards = data
    model = "\n".join(
        f'{key} = "{value}"' if key == "model.source" else f"{key} = {value}"
        for key, value in (item.split("=", 1) for item in SMALL_MODEL)
    )
    file = tmp_path / "p.toml"
    file.write_text(PIPELINE.format(shards=shards, tokenizer=tokenizer, model=model))
    return file


def test_a_pipeline_run_directory_has_one_runner(tmp_path, data):
    from lmforge.pipeline import run_pipeline

    pipeline = load_pipeline(_pipeline(tmp_path, data), workdir=tmp_path)
    in_use = pytest.raises(DirectoryInUseError, match=f"pid {os.getpid()}")
    with one_writer(tmp_path / "runs" / "p"), in_use:
        run_pipeline(pipeline, launcher="local")
    assert not list((tmp_path / "runs" / "p").rglob("manifest.json"))


def test_sigterm_to_lmforge_run_stops_its_stage_which_saves(tmp_path, data):
    file = _pipeline(tmp_path, data)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge", "run", str(file)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stage_dir = tmp_path / "runs" / "p" / "pre"
    metrics = stage_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, stage_dir / "stage.log"
        time.sleep(0.1)
    below = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    manifest = read_manifest(stage_dir)
    assert manifest["status"] == "cancelled" and manifest["reason"] == "terminated (SIGTERM)"
    assert list((stage_dir / "checkpoints").glob("step-*")), "the trainer did not save"
    time.sleep(0.5)
    alive = [pid for pid in below if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
    assert not alive, f"processes {alive} outlived `lmforge run`"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


# ---- pipeline files with mistakes: the first cause, once -----------------------------------


def test_pipeline_mistakes_name_their_first_cause(tmp_path, data):
    file = _pipeline(tmp_path, data)
    base = file.read_text()
    file.write_text(base + '\n[stages.tuned]\nkind = "sft"\nfrom = "pre"\n')
    with pytest.raises(ConfigError) as err:
        load_pipeline(file, workdir=tmp_path, overrides=["stages.pre.train.steps=abc"])
    assert "train.steps" in str(err.value) and "'tuned'" not in str(err.value), err.value

    with pytest.raises(ConfigError, match="has no stage 'nosuch'; its stages: pre, tuned"):
        load_pipeline(file, workdir=tmp_path, overrides=["stages.nosuch.train.steps=3"])

    cycle = '\n[stages.a]\nkind = "sft"\nfrom = "b"\n[stages.b]\nkind = "sft"\nfrom = "a"\n'
    file.write_text(base + cycle)
    with pytest.raises(ConfigError, match="stages a -> b -> a form a cycle"):
        load_pipeline(file, workdir=tmp_path)

    file.write_text(base.replace("[stages.pre]", '[stages.first]\nkind = "sft"\nfrom = "x"\n'
                                 "[stages.pre]"))  # fmt: skip
    with pytest.raises(ConfigError, match="from = 'x' names no stage; it is the first stage"):
        load_pipeline(file, workdir=tmp_path)


def test_a_stage_whose_runner_died_before_it_started_is_not_started(tmp_path, data):
    file = _pipeline(tmp_path, data)
    stage_dir = tmp_path / "runs" / "p" / "pre"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_manifest(
        stage_dir,
        {"stage": "pre", "status": "pending", "runner": {"pid": dead.pid,
         "host": socket.gethostname()}},
    )  # fmt: skip
    (status,) = pipeline_status(tmp_path / "runs" / "p")
    assert status.status == "not_started", status
    assert f"(pid {dead.pid}) is gone: it was killed or lost its machine first" in status.reason
    assert file.exists() and json.loads((stage_dir / "manifest.json").read_text())


def test_several_ranks_are_refused_together_without_hanging(tmp_path, data):
    """Rank 0 alone takes the lock; its refusal reaches the other rank (a refused rank 0 must
    not leave rank 1 waiting in a collective)."""
    from tests.train_utils import torchrun

    tokenizer, shards = data
    run_dir = tmp_path / "run"
    args = pretrain_args(run_dir, tokenizer, shards, "train.steps=2")
    with one_writer(run_dir):
        proc = torchrun(2, "pretrain", args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)  # fmt: skip
        out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0, out[-3000:]
    refusals = [line for line in out.splitlines() if f"is in use by pid {os.getpid()}" in line]
    assert refusals, out[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()
