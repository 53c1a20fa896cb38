"""Expert parallelism (parallel.ep) on gloo processes against one process: EP 2 (two processes,
each holding two of the four experts), EP 2 × FSDP 2 (four processes, dp_shard = 4, each pair
of experts sharded over two ranks) and EP 2 under HSDP 2 × 2 give one process's losses, aux
losses, gradient norms and expert loads; a run resumed from its DCP checkpoint repeats its
steps bit for bit; the artifact holds every expert, equals the one process's and loads in
transformers. Config errors name parallel.ep and what is allowed; the planner splits the
experts as parallelize() does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import lmforge
from lmforge import models
from lmforge.errors import ConfigError
from lmforge.parallel.config import ParallelSection
from lmforge.parallel.distributed import mesh_shape
from lmforge.parallel.expert_parallel import apply_expert_parallel
from tests.test_moe_training import moe_pretrain_args
from tests.train_utils import (
    make_shards,
    run_inprocess,
    run_torchrun,
    small_args,
    small_qwen3_moe_args,
    torchrun,
)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

MOE_KEYS = ("loss", "aux_loss", "grad_norm")


def _records(run_dir: Path) -> dict[int, dict]:
    """step -> record of metrics.jsonl (the last one wins for a step run again)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _assert_same_run(many: dict[int, dict], one: dict[int, dict]) -> None:
    assert sorted(many) == sorted(one)
    for step, record in one.items():
        for key in MOE_KEYS:
            assert many[step][key] == pytest.approx(record[key], rel=1e-5, abs=1e-6), (step, key)
        loads = [k for k in record if k.startswith("expert_load")]
        assert loads
        for key in loads:  # routing is local: the same tokens choose the same experts
            assert many[step][key] == record[key], (step, key)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors.load_file(run_dir / "artifact" / "model.safetensors")


# ---- configuration ----------------------------------------------------------------------------


def test_ep_must_divide_dp_shard_and_combine_with_what_it_supports():
    assert mesh_shape(ParallelSection(ep=2), 4) == (1, 4, 1)
    assert mesh_shape(ParallelSection(ep=2, dp_replicate=2), 4) == (2, 2, 1)
    with pytest.raises(ConfigError, match=r"parallel.ep = 3 must divide .*\[1, 2, 4\]"):
        mesh_shape(ParallelSection(ep=3), 4)
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 must divide parallel.dp_shard \(1"):
        mesh_shape(ParallelSection(ep=2, dp_replicate=2), 2)
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 cannot be combined with parallel.tp"):
        mesh_shape(ParallelSection(ep=2, tp=2), 4)
    with pytest.raises(ConfigError, match=r"parallel.compile"):
        mesh_shape(ParallelSection(ep=2, compile=True), 2)


class _Mesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_ep_needs_experts_it_divides():
    with torch.device("meta"):
        dense = models.new_model(small_args())
        moe = models.new_model(small_qwen3_moe_args())
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts model"):
        apply_expert_parallel(dense, _Mesh(2))
    with pytest.raises(
        ConfigError, match=r"must divide the model's num_experts \(4\).*\[1, 2, 4\]"
    ):
        apply_expert_parallel(moe, _Mesh(3))


# ---- training against one process -------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("ep-data"))


def test_cli_exits_2_on_an_ep_the_world_cannot_hold(tmp_path, data, capsys):
    args = moe_pretrain_args(tmp_path / "run", data, "parallel.ep=2")
    assert run_inprocess("pretrain", args) == 2
    assert "parallel.ep = 2 must divide parallel.dp_shard (1" in capsys.readouterr().err


def test_ep2_matches_one_process_resumes_and_exports_every_expert(tmp_path, data):
    """Two processes, parallel.ep = 2: each holds experts {0, 1} or {2, 3} and no FSDP shard of
    them (dp_shard / ep = 1). One row a micro-batch in both layouts (the aux loss is each
    micro-batch's own). Checkpoints at steps 2, 4, 5: a copy resumed from step 2 repeats steps
    3-5 exactly."""
    common = ["train.micro_batch_size=1", "checkpoint.export_dtype=float32"]
    one_dir, ep_dir = tmp_path / "one", tmp_path / "ep"
    args = [*common, "train.global_batch_size=2"]
    assert run_inprocess("pretrain", moe_pretrain_args(one_dir, data, *args)) == 0
    saves = ["checkpoint.every=2", "checkpoint.keep_last=3", "parallel.ep=2"]
    run_torchrun(2, "pretrain", moe_pretrain_args(ep_dir, data, *common, *saves))
    one, ep = _records(one_dir), _records(ep_dir)
    assert one[5]["loss"] < one[1]["loss"]
    _assert_same_run(ep, one)

    # The artifact: all four experts of each layer, the one process's weights.
    ours, reference = _weights(ep_dir), _weights(one_dir)
    assert ours.keys() == reference.keys()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in ours
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, atol=2e-5, rtol=1e-4, msg=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ep_dir / "artifact").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts == 4
    model = lmforge.load(ep_dir / "artifact", dtype=torch.float32).model.eval()
    tokens = torch.arange(1, 17)[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=0)

    # Resume under EP from the DCP checkpoint of step 2.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(ep_dir, resumed_dir)
    checkpoints = sorted(p.name for p in (resumed_dir / "checkpoints").glob("step-*"))
    assert checkpoints == [f"step-{step:08d}" for step in (2, 4, 5)], checkpoints
    for name in checkpoints[1:]:
        shutil.rmtree(resumed_dir / "checkpoints" / name)
    proc = torchrun(
        2,
        "pretrain",
        moe_pretrain_args(resumed_dir, data, *common, *saves),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert "resumed from step 2" in out
    resumed = _records(resumed_dir)
    for step in (3, 4, 5):
        for key in (*MOE_KEYS, "expert_load_max_mean"):
            assert resumed[step][key] == ep[step][key], (step, key)
    assert _weights(resumed_dir).keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(_weights(resumed_dir)[name], tensor), name


@pytest.mark.parametrize("replicate", [1, 2], ids=["fsdp", "hsdp"])
def test_ep2_times_fsdp2_matches_one_process(tmp_path, data, replicate):
    """Four processes with parallel.ep = 2: ranks {0, 1} and {2, 3} are the EP groups. dp_shard
    = 4: each rank's two experts FSDP-sharded with the rank holding the same ones; dp_replicate
    = 2 × dp_shard = 2 (HSDP): replicated there instead."""
    common = ["train.micro_batch_size=1", "checkpoint.export_dtype=float32"]
    args = [*common, "train.global_batch_size=4"]
    assert run_inprocess("pretrain", moe_pretrain_args(tmp_path / "one", data, *args)) == 0
    layout = ["parallel.ep=2", f"parallel.dp_replicate={replicate}"]
    run_torchrun(4, "pretrain", moe_pretrain_args(tmp_path / "ep", data, *common, *layout))
    _assert_same_run(_records(tmp_path / "ep"), _records(tmp_path / "one"))
    ours, reference = _weights(tmp_path / "ep"), _weights(tmp_path / "one")
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, atol=2e-5, rtol=1e-4, msg=name)


# ---- the planner ------------------------------------------------------------------------------


@pytest.mark.parametrize(("gpus", "ep"), [(4, 2), (4, 4), (8, 2)])
def test_planner_splits_the_experts_as_parallelize_does(gpus, ep):
    """Each rank's shard of the stacked experts: E / ep experts, FSDP-sharded over the
    dp_shard / ep ranks holding the same ones (the dry run applies the real parallelize());
    gathered (FSDP's all-gather), a rank holds E / ep experts, not E."""
    from lmforge.plan import dry_run, plan_memory
    from lmforge.plan.memory import Setup, param_specs, tp_local_numel

    args = small_qwen3_moe_args(num_experts=8)
    setup = Setup(args=args, method="pretrain", gpus=gpus, ep=ep, seq_len=64)
    report = dry_run(setup)
    assert report.mismatches == [] and report.measured == report.arithmetic
    w13 = report.tensors["layers.0.feed_forward.experts.w13"]
    assert w13.shape == (8, 64, 64)  # the name and full shape a checkpoint keeps
    assert w13.local_shape == (8 // gpus, 64, 64)  # E / ep experts over dp_shard / ep ranks
    plain = setup.replace(ep=1)
    experts = [s for s in param_specs(setup) if s.expert]
    assert len(experts) == 2 * args.num_layers
    for spec in experts:
        assert tp_local_numel(spec, setup) * ep == tp_local_numel(spec, plain)
    # Persistent state is the same (sharded over all ranks either way); FSDP's gathered copies
    # of a block shrink by the experts' (ep - 1) / ep.
    assert plan_memory(setup).largest("parameters") == plan_memory(plain).largest("parameters")
    assert plan_memory(setup).largest("weight copies") < plan_memory(plain).largest("weight copies")


def test_planner_refuses_what_the_trainer_refuses():
    from lmforge.plan.memory import Setup, check_setup

    moe = small_qwen3_moe_args()
    with pytest.raises(ConfigError, match=r"must divide the model's num_experts \(4\)"):
        check_setup(Setup(args=moe, gpus=8, ep=8))
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts model"):
        check_setup(Setup(args=small_args(), gpus=2, ep=2))
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 must divide parallel.dp_shard"):
        check_setup(Setup(args=moe, gpus=1, ep=2))


def test_plan_cli_takes_ep(capsys):
    from lmforge import cli

    code = cli.main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--ep", "8"])
    out = capsys.readouterr().out
    assert code in (0, 1), out  # (fits or not: a plan either way)
    assert "experts split over ep 8" in out
