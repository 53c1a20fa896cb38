"""SFT (LoRA) and DPO on the one loop: layout equivalence, kill-and-resume, the DPO loss against
hand-computed values, and the PEFT adapter written next to the merged artifact."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lmforge
from lmforge.api import build_model, save_state
from lmforge.train.losses import dpo_loss
from tests.train_utils import (
    demo_world,
    kill_all,
    losses,
    run_inprocess,
    run_torchrun,
    small_family_args,
    wait_for_step,
)

GOLDEN_DPO = Path(__file__).parent / "golden" / "dpo_losses.json"


def _base(root: Path, *, tied: bool, family: str = "llama", **shape):
    """A small random base artifact with the demo tokenizer, and the demo data."""
    paths, tokenizer, _ = demo_world(root, vocab_size=400)
    args = small_family_args(family, tokenizer.vocab_size, tie_embeddings=tied, **shape)
    artifact = save_state(
        build_model(args, seed=3).state_dict(),
        args,
        tokenizer,
        root / "base",
        stage="test",
        parent=None,
    )
    return artifact, paths


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _base(tmp_path_factory.mktemp("post"), tied=False)


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory):
    """The same with tied embeddings (as Llama 3.2 1B and 3B ship)."""
    return _base(tmp_path_factory.mktemp("post-tied"), tied=True)


@pytest.fixture(scope="module")
def qwen3_base(tmp_path_factory):
    """A Qwen3 (q/k head norms, head_dim 24 != dim / heads), tied as the small Qwen3s ship."""
    return _base(tmp_path_factory.mktemp("post-qwen3"), tied=True, family="qwen3")


@pytest.fixture(scope="module")
def qlora_base(tmp_path_factory):
    """Tied, and wide enough (dim 256) that each NF4 base splits into 2 FSDP shards of whole
    scale groups."""
    return _base(tmp_path_factory.mktemp("post-qlora"), tied=True, dim=256, ffn_dim=512)


def common(run_dir: Path, artifact: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"model.source={artifact}",
        "train.micro_batch_size=4",
        "train.steps=5",
        "train.deterministic=true",
        "scheduler.warmup_steps=1",
        "optim.lr=1e-2",
        "metrics.log_every=1",
        "metrics.tensorboard=false",
        "checkpoint.every=0",
        "data.max_seq_len=48",
        *extra,
    ]


def lora_args(run_dir, base, data: str, *extra):
    """A rank-4 LoRA run on the demo file `data` (sft_train / dpo_train)."""
    artifact, paths = base
    return common(
        run_dir, artifact, f"data.path={paths[data]}", "lora.enabled=true", "lora.rank=4", *extra
    )


def sft_args(run_dir, base, *extra):
    return lora_args(run_dir, base, "sft_train", *extra)


def dpo_args(run_dir, base, *extra):
    return lora_args(run_dir, base, "dpo_train", "dpo.beta=0.5", *extra)


def qlora_sft_args(run_dir, base, *extra):
    return sft_args(run_dir, base, "lora.quantize_base=nf4", *extra)


def qlora_dpo_args(run_dir, base, *extra):
    return dpo_args(run_dir, base, "lora.quantize_base=nf4", *extra)


def full_sft_args(run_dir, base, *extra):
    artifact, paths = base
    return common(run_dir, artifact, f"data.path={paths['sft_train']}", "optim.lr=1e-3", *extra)


def full_dpo_args(run_dir, base, *extra):
    artifact, paths = base
    return common(run_dir, artifact, f"data.path={paths['dpo_train']}", "dpo.beta=0.5", *extra)


FSDP_2 = ["train.micro_batch_size=2"]
TP_2 = ["parallel.tp=2"]  # batches of odd widths padded for sequence parallelism


@pytest.mark.parametrize(
    "stage, make_args, which, parallel",
    [
        ("sft", sft_args, "base", FSDP_2),
        ("dpo", dpo_args, "base", FSDP_2),
        ("sft", sft_args, "tied_base", FSDP_2),
        ("sft", full_sft_args, "tied_base", FSDP_2),
        ("dpo", dpo_args, "tied_base", FSDP_2),
        ("dpo", full_dpo_args, "tied_base", FSDP_2),
        ("sft", qlora_sft_args, "qlora_base", FSDP_2),
        ("dpo", qlora_dpo_args, "qlora_base", FSDP_2),
        ("sft", full_sft_args, "base", TP_2),
        ("dpo", full_dpo_args, "base", TP_2),
    ],
    ids=[
        "sft-lora",
        "dpo-lora",
        "tied-sft-lora",
        "tied-sft-full",
        "tied-dpo-lora",
        "tied-dpo-full",
        "tied-sft-qlora",
        "tied-dpo-qlora",
        "tp-sft-full",
        "tp-dpo-full",
    ],
)
def test_two_processes_match_one(tmp_path, request, stage, make_args, which, parallel):
    base = request.getfixturevalue(which)
    assert run_inprocess(stage, make_args(tmp_path / "one", base)) == 0
    reference = losses(tmp_path / "one")
    run_torchrun(2, stage, make_args(tmp_path / "two", base, *parallel))
    two = losses(tmp_path / "two")
    assert sorted(two) == sorted(reference) == [1, 2, 3, 4, 5]
    for step in reference:
        assert abs(two[step] - reference[step]) <= 1e-5, (step, two[step], reference[step])
    if stage == "sft":
        assert reference[5] < reference[1]


@pytest.mark.parametrize("stage, make_args", [("sft", sft_args), ("dpo", dpo_args)])
def test_kill_and_resume_matches_uninterrupted(tmp_path, base, stage, make_args):
    extra = ["train.steps=12", "checkpoint.every=4"]
    assert run_inprocess(stage, make_args(tmp_path / "reference", base, *extra)) == 0
    reference = losses(tmp_path / "reference")
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge", stage, *make_args(run_dir, base, *extra)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wait_for_step(run_dir, 6, proc)
    kill_all(proc)
    (run_dir / "metrics.jsonl").unlink()
    assert run_inprocess(stage, make_args(run_dir, base, *extra)) == 0
    resumed = losses(run_dir)
    assert min(resumed) in (5, 9) and max(resumed) == 12
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)


def test_dpo_loss_matches_hand_computed_values():
    golden = json.loads(GOLDEN_DPO.read_text())
    logps = torch.tensor(golden["logps"], dtype=torch.float64)
    for case in golden["cases"]:
        got, chosen, rejected = dpo_loss(
            logps[:, 0],
            logps[:, 1],
            logps[:, 2],
            logps[:, 3],
            beta=case["beta"],
            label_smoothing=case["label_smoothing"],
            loss_type=case["loss_type"],
        )
        want = case["expected"]
        assert torch.allclose(
            got, torch.tensor([w["loss"] for w in want], dtype=torch.float64), atol=1e-12
        )
        assert torch.allclose(
            chosen, torch.tensor([w["reward_chosen"] for w in want], dtype=torch.float64)
        )
        assert torch.allclose(
            rejected, torch.tensor([w["reward_rejected"] for w in want], dtype=torch.float64)
        )


def test_bf16_lora_keeps_frozen_linears_in_bf16_with_and_without_fsdp(tmp_path, base, caplog):
    bf16 = "train.mixed_precision=bf16"
    with caplog.at_level("WARNING"):
        assert run_inprocess("sft", sft_args(tmp_path / "one", base, bf16)) == 0
    assert "LoRA: frozen linear weights in bfloat16" in caplog.text
    reference = losses(tmp_path / "one")
    run_torchrun(2, "sft", sft_args(tmp_path / "two", base, bf16, "train.micro_batch_size=2"))
    two = losses(tmp_path / "two")  # FSDP2: bf16 frozen and fp32 trainable shards, one group
    assert sorted(two) == sorted(reference) == [1, 2, 3, 4, 5]
    for step in reference:  # bf16 compute: autocast (one process) vs FSDP's casts (two)
        assert abs(two[step] - reference[step]) <= 5e-3, (step, two[step], reference[step])
    assert reference[5] < reference[1] and two[5] < two[1]
    # gradients reduce-scattered in bf16 (parallel.reduce_dtype): the same steps, near
    bf16_reduce = sft_args(tmp_path / "bf16r", base, bf16, "train.micro_batch_size=2",
                           "parallel.reduce_dtype=bfloat16")  # fmt: skip
    run_torchrun(2, "sft", bf16_reduce)
    three = losses(tmp_path / "bf16r")
    assert sorted(three) == sorted(reference)
    for step in reference:
        assert abs(three[step] - two[step]) <= 1e-2, (step, three[step], two[step])


def test_sft_lora_writes_merged_artifact_and_peft_adapter(tmp_path, base):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    assert run_inprocess("sft", sft_args(tmp_path / "run", base)) == 0
    artifact = tmp_path / "run" / "artifact"
    lineage = json.loads((artifact / "lmforge.json").read_text())
    assert lineage["stage"] == "sft" and lineage["parent"]["hash"]
    merged = lmforge.load(artifact)
    tokens = torch.randint(0, merged.config.vocab_size, (2, 12))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base[0]).eval()
    with_adapter = peft.PeftModel.from_pretrained(hf_base, artifact / "adapter").eval()
    with torch.no_grad():
        ours = merged.model(tokens)
        theirs = with_adapter(tokens).logits
    # The artifact is stored in bf16 (checkpoint.export_dtype); compare at that precision.
    assert (ours.float() - theirs).abs().max().item() < 0.05
    baseline = lmforge.load(base[0]).model(tokens)
    assert (ours.float() - baseline).abs().max().item() > 1e-3  # the adapter changed something


@pytest.mark.parametrize(
    "stage, make_args", [("sft", full_sft_args), ("dpo", dpo_args)], ids=["sft-full", "dpo-lora"]
)
def test_qwen3_trains_through_the_same_loop(tmp_path, qwen3_base, stage, make_args):
    """Full SFT and LoRA DPO on a Qwen3 through the one loop (PEFT parity of its adapters:
    tests/test_lora.py); the artifacts keep the family."""
    assert run_inprocess(stage, make_args(tmp_path / "run", qwen3_base)) == 0
    steps = losses(tmp_path / "run")
    assert sorted(steps) == [1, 2, 3, 4, 5] and all(math.isfinite(v) for v in steps.values())
    if stage == "sft":
        assert steps[5] < steps[1]
    config = json.loads((tmp_path / "run" / "artifact" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["head_dim"] == 24
    assert lmforge.load(tmp_path / "run" / "artifact").config.family == "qwen3"


def test_peft_adapter_names_its_base_by_absolute_path(tmp_path, base, monkeypatch):
    """`AutoPeftModelForCausalLM` finds the base from any working directory, also when the run
    named it by a relative path."""
    peft = pytest.importorskip("peft")
    artifact, paths = base
    monkeypatch.chdir(artifact.parent)
    run_dir = tmp_path / "run"
    assert (
        run_inprocess("sft", sft_args(run_dir, (Path(artifact.name), paths), "train.steps=1")) == 0
    )
    adapter = run_dir / "artifact" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(artifact.resolve())
    monkeypatch.chdir(tmp_path)
    model = peft.AutoPeftModelForCausalLM.from_pretrained(adapter)
    assert model.peft_config["default"].r == 4


@pytest.mark.parametrize(
    "stage, make_args, heldout",
    [("sft", sft_args, "sft_heldout"), ("dpo", dpo_args, "dpo_heldout")],
)
def test_held_out_loss_every_n_steps_equal_on_two_ranks(tmp_path, base, stage, make_args, heldout):
    _, paths = base
    extra = ["train.eval_every=2", f"data.heldout={paths[heldout]}"]
    assert run_inprocess(stage, make_args(tmp_path / "one", base, *extra)) == 0
    run_torchrun(2, stage, make_args(tmp_path / "two", base, "train.micro_batch_size=2", *extra))
    logged = {}
    for name in ("one", "two"):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        logged[name] = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(logged["one"]) == [2, 4, 5]  # every 2 steps and the last one
    for step, value in logged["one"].items():
        assert math.isfinite(value) and abs(logged["two"][step] - value) <= 1e-5, (step, logged)
    assert logged["one"][5] != logged["one"][2]  # the model changed in between


def test_eval_every_needs_held_out_data(tmp_path, base, capsys):
    assert run_inprocess("sft", sft_args(tmp_path / "run", base, "train.eval_every=2")) == 2
    assert "set data.heldout" in capsys.readouterr().err


@pytest.mark.parametrize(
    "precision, device, expected",
    [
        ("bf16", "cpu", True),
        ("auto", "cpu", False),
        ("fp32", "cpu", False),
        ("bf16", "cuda", True),
        ("auto", "cuda", True),
        ("fp32", "cuda", False),
    ],
)
def test_one_rule_decides_bf16_compute(precision, device, expected):
    from types import SimpleNamespace

    from lmforge.config import load_config
    from lmforge.train.config import DPOJob
    from lmforge.train.stage import computes_in_bf16

    job = load_config(DPOJob, None, [f"train.mixed_precision={precision}"])
    layout = SimpleNamespace(device=torch.device(device))
    assert computes_in_bf16(job, layout) is expected


def test_dpo_frozen_reference_computes_in_the_policys_precision(tmp_path, base, monkeypatch):
    """On the CPU with mixed_precision = "bf16", DPO's frozen reference copy is built for bf16
    as the policy is (train/stage.py and train/dpo.py once decided this each on their own)."""
    from lmforge.train import stage

    built = []
    build = stage.build_and_load_model

    def recording(spec, layout, job, *, bf16, **options):
        built.append(bf16)
        return build(spec, layout, job, bf16=bf16, **options)

    monkeypatch.setattr(stage, "build_and_load_model", recording)  # (dpo's reference too)
    args = full_dpo_args(tmp_path / "run", base, "train.mixed_precision=bf16", "train.steps=1")
    assert run_inprocess("dpo", args) == 0
    assert built == [True, True]  # the policy, then its frozen reference
