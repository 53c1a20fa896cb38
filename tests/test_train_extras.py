"""Training outputs beyond the loss: metrics files, TensorBoard events, profiler traces, async
checkpoints, a resume on a different number of processes, and config errors."""

from __future__ import annotations

import json

import pytest

from lmforge.cli import main as cli_main
from tests.train_utils import losses, make_shards, pretrain_args, run_inprocess, run_torchrun


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("data"))


def test_metrics_tensorboard_and_profiler_outputs(tmp_path, data):
    tokenizer, shards = data
    run_dir = tmp_path / "run"
    args = pretrain_args(
        run_dir,
        tokenizer,
        shards,
        "train.steps=6",
        "metrics.tensorboard=true",
        "profile.enabled=true",
        "profile.start_step=2",
        "profile.num_steps=2",
    )
    assert run_inprocess("pretrain", args) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb", "eta_s"):
        assert all(key in r for r in records), key
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    traces = list((run_dir / "profile").glob("*.pt.trace.json*"))
    assert traces, sorted(p.name for p in (run_dir / "profile").iterdir())
    lineage = json.loads((run_dir / "artifact" / "lmforge.json").read_text())
    assert lineage["stage"] == "pretrain" and lineage["metrics"]["step"] == 6


def test_async_checkpoints_resume(tmp_path, data):
    tokenizer, shards = data
    reference = tmp_path / "reference"
    run_inprocess("pretrain", pretrain_args(reference, tokenizer, shards, "train.steps=8"))
    run_dir = tmp_path / "async"
    args = pretrain_args(
        run_dir,
        tokenizer,
        shards,
        "train.steps=8",
        "checkpoint.every=2",
        "checkpoint.async_save=true",
    )
    assert run_inprocess("pretrain", args) == 0
    assert losses(run_dir) == losses(reference)  # saving in the background changes nothing
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    assert [c.name for c in checkpoints] == ["step-00000006", "step-00000008"]
    import shutil

    shutil.rmtree(checkpoints[-1])
    (run_dir / "metrics.jsonl").unlink()
    assert run_inprocess("pretrain", args) == 0
    assert losses(run_dir) == {s: losses(reference)[s] for s in (7, 8)}


def test_resume_on_fewer_processes(tmp_path, data, caplog):
    tokenizer, shards = data
    import shutil

    run_dir = tmp_path / "run"
    extra = ["train.steps=7", "checkpoint.every=4"]
    run_torchrun(
        2, "pretrain", pretrain_args(run_dir, tokenizer, shards, *extra, "train.micro_batch_size=2")
    )
    want = losses(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000007")
    (run_dir / "metrics.jsonl").unlink()
    # One process with twice the micro-batch: the same global batch, model and optimizer
    # resharded by DCP, the data position carried over globally.
    assert run_inprocess("pretrain", pretrain_args(run_dir, tokenizer, shards, *extra)) == 0
    resumed = losses(run_dir)
    assert sorted(resumed) == [5, 6, 7]
    for step in (5, 6, 7):
        assert abs(resumed[step] - want[step]) <= 1e-5, (step, resumed[step], want[step])
    assert "cannot be carried over" in caplog.text


def test_config_errors_exit_2_with_one_line(tmp_path, data, capsys):
    tokenizer, shards = data
    code = cli_main(["pretrain", *pretrain_args(tmp_path, tokenizer, shards, "train.stepz=3")])
    assert code == 2
    err = capsys.readouterr().err
    assert "train.stepz" in err and "steps" in err and "Traceback" not in err
    code = cli_main(["pretrain", *pretrain_args(tmp_path, tokenizer, shards, "parallel.tp=3")])
    assert code == 2
    assert (
        "world size 1 is not divisible by parallel.dp_replicate (1) × parallel.tp (3)"
        in capsys.readouterr().err
    )
    code = cli_main(
        ["pretrain", *pretrain_args(tmp_path, tokenizer, shards, "train.global_batch_size=6")]
    )
    assert code == 2
    assert "global_batch_size (6) must be a multiple" in capsys.readouterr().err
