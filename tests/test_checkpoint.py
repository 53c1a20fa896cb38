"""Checkpoints: exact round trips, pruning, completeness checks, never overwriting, and real
torchrun + FSDP2 runs SIGKILLed at random moments (mid-save too), then a 2→1 rank reshard."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

from lmforge.errors import ConfigError
from lmforge.models.llama import Transformer
from lmforge.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    ModelOptimizerState,
    RNGState,
    checkpoint_problem,
)
from tests.scripts import checkpoint_worker as worker
from tests.train_utils import descendants, small_args

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "scripts" / "checkpoint_worker.py"
SMALL = small_args(256)


def make_training(seed: int):
    torch.manual_seed(seed)
    model = Transformer(SMALL)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, SMALL.vocab_size, (2, 17))  # global RNG: restored too
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def assert_identical(a, b, where="") -> None:
    """Nested dicts/lists of tensors and plain values, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"tensors differ at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {key: clone(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone(value) for value in state)
    return state


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


# ---- one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_round_trip_is_bit_identical_and_training_continues_equally(tmp_path, async_save):
    model, optimizer, scheduler = make_training(seed=0)
    train(model, optimizer, scheduler, 2)
    state = {
        "model": ModelOptimizerState(model, optimizer),
        "scheduler": scheduler,
        "rng": RNGState(),
        "train": {"step": 2, "tokens": 64},
        "note": "plain values too",
    }
    checkpointer = Checkpointer(tmp_path, async_save=async_save)
    checkpointer.save(2, state)
    expected_model = clone(model.state_dict())
    expected_optimizer = clone(optimizer.state_dict())
    expected_scheduler = clone(scheduler.state_dict())
    expected_draws = draws()
    expected_losses = train(model, optimizer, scheduler, 3)  # changes the weights after save
    if async_save:
        assert checkpointer.latest() is None  # written, perhaps, but not committed before wait
    checkpointer.close()
    assert checkpointer.latest() == tmp_path / "checkpoints" / "step-00000002"

    model2, optimizer2, scheduler2 = make_training(seed=1)
    state2 = {
        "model": ModelOptimizerState(model2, optimizer2),
        "scheduler": scheduler2,
        "rng": RNGState(),
        "train": {"step": 0, "tokens": 0},
        "note": "",
    }
    train_dict = state2["train"]
    assert Checkpointer(tmp_path).restore_latest(state2) == 2
    assert_identical(model2.state_dict(), expected_model, "model")
    assert_identical(optimizer2.state_dict(), expected_optimizer, "optimizer")
    assert_identical(scheduler2.state_dict(), expected_scheduler, "scheduler")
    assert train_dict == {"step": 2, "tokens": 64} and state2["train"] is train_dict  # in place
    assert state2["note"] == "plain values too"
    assert_identical(draws(), expected_draws, "rng draws")
    assert train(model2, optimizer2, scheduler2, 3) == expected_losses


def test_trainable_only_saves_and_restores_just_trainable_params(tmp_path):
    model, _, _ = make_training(seed=0)
    model.tok_embeddings.weight.requires_grad_(False)
    frozen = model.tok_embeddings.weight.detach().clone()
    Checkpointer(tmp_path).save(1, {"model": ModelOptimizerState(model, trainable_only=True)})
    path = tmp_path / "checkpoints" / "step-00000001"
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys()
    assert "model.model.output.weight" in keys
    assert not any("tok_embeddings" in key for key in keys)

    model2, _, _ = make_training(seed=1)
    model2.tok_embeddings.weight.requires_grad_(False)
    own_frozen = model2.tok_embeddings.weight.detach().clone()
    Checkpointer(tmp_path).load(path, {"model": ModelOptimizerState(model2, trainable_only=True)})
    assert torch.equal(model2.output.weight, model.output.weight)
    assert torch.equal(model2.tok_embeddings.weight, own_frozen)
    assert not torch.equal(own_frozen, frozen)


def small_state(step: int) -> dict:
    return {"model": torch.nn.Linear(3, 2), "train": {"step": step}}


def test_keep_last_prunes_old_checkpoints_and_must_be_at_least_two(tmp_path):
    for keep_last in (2, 3):
        checkpointer = Checkpointer(tmp_path / str(keep_last), keep_last=keep_last)
        for step in range(1, 6):
            checkpointer.save(step, small_state(step))
        names = sorted(p.name for p in (tmp_path / str(keep_last) / "checkpoints").iterdir())
        assert names == [f"step-{step:08d}" for step in range(6 - keep_last, 6)]
    with pytest.raises(ConfigError, match="keep_last=1"):
        Checkpointer(tmp_path, keep_last=1)


def test_latest_skips_uncommitted_and_truncated_checkpoints(tmp_path, caplog):
    checkpointer = Checkpointer(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        checkpointer.save(step, small_state(step))
    root = tmp_path / "checkpoints"
    (root / "step-00000003" / "COMMITTED").unlink()
    shard = root / "step-00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    partial = root / ".tmp-step-00000004-0badf00d"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")

    with caplog.at_level(logging.WARNING):
        assert checkpointer.latest() == root / "step-00000001"
    assert "step-00000003" in caplog.text and "no COMMITTED marker" in caplog.text
    assert "step-00000002" in caplog.text and "__0_0.distcp has" in caplog.text
    assert ".tmp-step-00000004-0badf00d" in caplog.text
    assert checkpoint_problem(root / "step-00000002") is not None
    with pytest.raises(CheckpointError, match="step-00000002"):
        checkpointer.load(root / "step-00000002", small_state(0))

    # the next save commits, keeps the only good older checkpoint, removes the partial one
    checkpointer.save(4, small_state(4))
    assert not partial.exists()
    assert [p.name for p in checkpointer.committed()] == ["step-00000001", "step-00000004"]
    state = small_state(0)
    assert checkpointer.restore_latest(state) == 4 and state["train"] == {"step": 4}


def test_a_committed_checkpoint_is_never_overwritten(tmp_path, caplog):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(5, small_state(5))
    final = tmp_path / "checkpoints" / "step-00000005"
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    with pytest.raises(CheckpointError, match="never overwritten"):
        checkpointer.save(5, small_state(55))
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert [p.name for p in final.parent.iterdir()] == ["step-00000005"]

    # an incomplete directory in the way is moved aside (and removed), not trusted
    junk = tmp_path / "checkpoints" / "step-00000006"
    junk.mkdir()
    (junk / "stray").write_text("not a checkpoint")
    with caplog.at_level(logging.WARNING):
        checkpointer.save(6, small_state(6))
    assert "step-00000006" in caplog.text
    assert checkpoint_problem(junk) is None and not (junk / "stray").exists()
    assert sorted(p.name for p in junk.parent.iterdir()) == ["step-00000005", "step-00000006"]


def test_per_rank_state_must_load_with_weights_only(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    with pytest.raises(TypeError, match=r"'dataloader'\['order'\] is a numpy.ndarray"):
        checkpointer.save(1, {"dataloader": {"order": np.arange(3)}})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="ModelOptimizerState"):
        checkpointer.save(1, {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    assert checkpointer.latest() is None


# ---- torchrun, FSDP2, SIGKILL ------------------------------------------------------------------

NUM_KILL_TRIALS = 4  # + 1 final run: each torchrun launch costs ~8 s of CPU
ASYNC_TRIALS = (1, 2)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers at once. torchrun starts each worker in a session of
    its own, so killing torchrun's process group alone would leave them running."""
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "workers survived SIGKILL"
        time.sleep(0.02)


def _launch(run_dir: Path, marker: Path, log: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    with open(log, "w") as out:
        return subprocess.Popen(
            [*command, str(WORKER), str(run_dir), "--marker", str(marker), *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"worker exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            _kill_all(proc)
            pytest.fail(f"timed out:\n{log.read_text()[-4000:]}")
        time.sleep(0.005)


def _partial_saves(run_dir: Path) -> set[Path]:
    return set(run_dir.glob("checkpoints/.tmp-step-*"))


def _newest_commit(run_dir: Path) -> int:
    return max((_step(p.parent) for p in run_dir.glob("checkpoints/step-*/COMMITTED")), default=0)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """Trials of a 2-rank FSDP2 run that saves every step, each SIGKILLed at a random moment
    (odd trials: just after a save has begun); each next trial restores and verifies the
    newest checkpoint; a last trial runs one step to completion and dumps the full state."""
    work = tmp_path_factory.mktemp("killed")
    run_dir, rng = work / "run", random.Random(1234)
    checkpointer = Checkpointer(run_dir)
    trials = []
    for trial in range(NUM_KILL_TRIALS + 1):
        before = checkpointer.latest()
        marker, log = work / f"marker{trial}.json", work / f"trial{trial}.log"
        last = trial == NUM_KILL_TRIALS
        args = (
            ["--steps", "1", "--dump-full"] if last else ["--async-save"] * (trial in ASYNC_TRIALS)
        )
        proc = _launch(run_dir, marker, log, *args)
        try:
            _wait_for(marker.exists, proc, log)
            if last:
                assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
            else:
                # once the run has committed a checkpoint of its own, kill it at a random
                # moment; odd trials: a random moment early in a save that has just begun
                done = _step(before) or 0
                _wait_for(lambda done=done: _newest_commit(run_dir) > done, proc, log)
                if trial % 2:
                    old = _partial_saves(run_dir)
                    _wait_for(lambda old=old: _partial_saves(run_dir) - old, proc, log)
                    # within a save's first few ms: a fast machine may commit it soon after
                    time.sleep(rng.uniform(0, 0.01))
                else:
                    time.sleep(rng.uniform(0, 1.0))
        finally:
            if proc.poll() is None:
                _kill_all(proc)
        after = checkpointer.latest()
        trials.append(
            {
                "marker": json.loads(marker.read_text()),
                "before": before,
                "after": after,
                "after_good": after is not None and checkpoint_problem(after) is None,
                "before_still_good": before is not None and checkpoint_problem(before) is None,
                "newer_committed": [p for p in checkpointer.committed() if before and p > before],
                "partial": sorted(_partial_saves(run_dir)),
            }
        )
    return run_dir, trials


def _step(path: Path | None) -> int | None:
    return None if path is None else int(path.name.split("-")[1])


@pytest.mark.slow
def test_sigkill_at_random_moments_never_breaks_the_latest_checkpoint(killed_run):
    _, trials = killed_run
    for number, trial in enumerate(trials):
        # every run restored exactly what `latest()` pointed to, checksums and all
        assert trial["marker"] == {"restored": _step(trial["before"]), "ok": True}, number
        assert trial["after_good"], number  # each trial ran until it had committed one
        if trial["before"] is not None:
            assert _step(trial["after"]) > _step(trial["before"]), number
            # the previous good checkpoint survives unless two newer ones are committed
            assert trial["before_still_good"] or len(trial["newer_committed"]) >= 2, number
    assert any(trial["partial"] for trial in trials[:-1]), "no kill hit a save in progress"
    assert _step(trials[-1]["after"]) == _step(trials[-1]["before"]) + 1 > 1


@pytest.mark.slow
def test_two_rank_checkpoint_loads_into_one_process(killed_run, caplog):
    run_dir, trials = killed_run
    full = torch.load(run_dir / "full.pt", weights_only=True)
    torch.manual_seed(99)
    model = Transformer(worker.MODEL_ARGS)
    model.init_weights()  # different weights from the run's
    optimizer = worker.build_optimizer(model)
    loader, progress = worker.CounterLoader(rank=0), {"step": 0, "checksum": 0.0}
    state = {
        "model": ModelOptimizerState(model, optimizer),
        "rng": RNGState(),
        "dataloader": loader,
        "train": progress,
    }
    rng_before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING):
        report = Checkpointer(run_dir).load(trials[-1]["after"], state)
    assert (report.saved_world_size, report.world_size, report.resharded) == (2, 1, True)
    assert report.not_carried_over == ("rng",) and "RNG streams" in caplog.text
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert loader.resharded_from == 2 and loader.position == report.step == progress["step"]
    assert_identical(model.state_dict(), full["model"], "model")
    _, optim_sd = get_state_dict(model, optimizer)
    assert_identical(optim_sd, full["optimizer"], "optimizer")
