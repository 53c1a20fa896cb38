"""Training outputs beyond the loss: metrics files, TensorBoard events, profiler traces, async
checkpoints, a resume on a different number of processes, and config errors."""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from lmforge.cli import main as cli_main
from lmforge.config import load_config
from lmforge.errors import ConfigError
from lmforge.models.llama import get_preset
from lmforge.parallel.config import ParallelSection
from lmforge.parallel.distributed import Layout
from lmforge.plan import plan_job, plan_memory, setup_from_job
from lmforge.plan.search import ReshardByPlan, resolve_reshard_after_forward
from lmforge.train import stage
from lmforge.train.config import PretrainJob
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
    code = cli_main(
        [
            "pretrain",
            *pretrain_args(tmp_path, tokenizer, shards, "parallel.reshard_after_forward=yes"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        'parallel.reshard_after_forward = "yes" (command line): must be true, false or "auto"'
        in err
    )


# ---- parallel.reshard_after_forward = "auto" --------------------------------------------------


def test_reshard_after_forward_values():
    assert ParallelSection().reshard_after_forward == "auto"
    for raw, value in (("true", True), ("false", False), ("auto", "auto"), ('"auto"', "auto")):
        job = load_config(PretrainJob, overrides=[f"parallel.reshard_after_forward={raw}"])
        assert job.parallel.reshard_after_forward == value
    for raw in ("1", '"true"', "sometimes"):
        with pytest.raises(ConfigError, match='must be true, false or "auto"'):
            load_config(PretrainJob, overrides=[f"parallel.reshard_after_forward={raw}"])


ONE_B_JOB = {"model": {"source": "llama3.2-1b"}, "train": {"micro_batch_size": 8}}


def _memory_where_kept_weights_fit(job: PretrainJob, gpus: int, *, fits: bool) -> int:
    """Device memory just above (fits) or below what "auto" needs to keep the gathered weights:
    the planner's total with reshard_after_forward = false, over 85%."""
    setup = setup_from_job(job, gpus=gpus).replace(reshard_after_forward=False)
    needed = plan_memory(setup).total / 0.85
    return math.ceil(needed + 2**30) if fits else math.floor(needed - 2**30)


def test_reshard_auto_rule_against_device_memory():
    job = PretrainJob.model_validate(ONE_B_JOB)
    setup = setup_from_job(job, gpus=2)
    assert setup.reshard_after_forward == "auto"
    roomy = _memory_where_kept_weights_fit(job, 2, fits=True)
    tight = _memory_where_kept_weights_fit(job, 2, fits=False)
    assert resolve_reshard_after_forward(setup, roomy) is False
    assert resolve_reshard_after_forward(setup, tight) is True
    assert resolve_reshard_after_forward(setup, None) is True  # the CPU
    assert resolve_reshard_after_forward(setup.replace(gpus=1), roomy) is True  # no FSDP
    for value in (True, False):  # set by the user: kept whatever the memory
        assert resolve_reshard_after_forward(setup.replace(reshard_after_forward=value), tight) is (
            value
        )
    # lmforge plan / lmforge run --dry-run model the same choice for the GPU they plan for.
    assert plan_job(job, gpus=2, gpu_memory=roomy).setup.reshard_after_forward is False
    assert plan_job(job, gpus=2, gpu_memory=tight).setup.reshard_after_forward is True


def _layout(device: str, world_size: int = 2) -> Layout:
    return Layout(
        rank=0,
        world_size=world_size,
        device=torch.device(device),
        mesh=None,
        dp_rank=0,
        dp_size=world_size,
        tp_size=1,
    )


@pytest.mark.parametrize("fits", [True, False])
def test_reshard_auto_at_start_up_reads_the_gpu_and_logs(monkeypatch, caplog, fits):
    job = PretrainJob.model_validate(ONE_B_JOB)
    spec = stage.ModelSpec(
        args=get_preset("llama3.2-1b"), tokenizer=None, source="llama3.2-1b", from_scratch=True
    )
    memory = _memory_where_kept_weights_fit(job, 2, fits=fits)
    properties = SimpleNamespace(total_memory=memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    assert (
        stage.resolved_parallel(job, spec, _layout("cuda"), ReshardByPlan()).reshard_after_forward
        is not fits
    )
    assert job.parallel.reshard_after_forward == "auto"  # the job itself is left as written
    with caplog.at_level(logging.WARNING, logger="lmforge.train.stage"):
        stage._log_reshard_choice(job, spec, _layout("cuda"), ReshardByPlan())
    assert len(caplog.messages) == 1
    assert caplog.messages[0].startswith(
        f"parallel.reshard_after_forward = auto -> {str(not fits).lower()} (the planner says"
    )
    assert (
        stage.resolved_parallel(job, spec, _layout("cpu"), ReshardByPlan()).reshard_after_forward
        is True
    )


def test_signals_are_the_callers_in_process_and_the_clis_in_its_own(tmp_path, data, monkeypatch):
    """`cli.main([...])` in a caller's process (pytest) leaves its signal handlers alone and lets
    Ctrl-C through, so the suite stops on Ctrl-C or SIGTERM; the CLI process (argv from the
    command line) takes SIGTERM and train.preempt_signal for preemption, and Ctrl-C as exit
    code 130 (the preemption itself: test_train.py, through subprocesses)."""
    import signal

    import lmforge.train.pretrain
    from lmforge import cli

    tokenizer, shards = data
    seen = {}

    def fake_pretrain(job, reshard):
        seen["handlers"] = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
        raise KeyboardInterrupt

    monkeypatch.setattr(lmforge.train.pretrain, "pretrain", fake_pretrain)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    argv = ["pretrain", *pretrain_args(tmp_path / "run", tokenizer, shards)]
    with pytest.raises(KeyboardInterrupt):
        cli_main(argv)
    assert seen["handlers"] == before

    monkeypatch.setattr(cli.sys, "argv", ["lmforge", *argv])
    assert cli_main() == 130  # as the console script runs it
    assert all(seen["handlers"][s] != before[s] for s in before)
    assert {s: signal.getsignal(s) for s in before} == before  # given back after the run
