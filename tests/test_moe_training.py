"""Every training command on a Mixture-of-Experts model (a tiny Qwen3-MoE): the loop adds the
load-balancing loss as transformers does (gradients against `Qwen3MoeForCausalLM`'s loss, and
what accumulation gives), logs the experts' load; pretraining over two FSDP2 processes (the
stacked experts sharded along dim 0) equals one process, and a SIGKILLed run resumes
bit-exactly; full SFT, DPO (a frozen reference) and GRPO (rollouts on the engine over the
weights being trained) run through the CLI; the report draws the load per layer.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

import lmforge
from lmforge.api import build_model
from lmforge.data.sft import IGNORE_INDEX
from lmforge.train.losses import causal_lm_loss
from tests.test_grpo import _grpo_world, grpo_args
from tests.test_post_training import _base, full_dpo_args, full_sft_args
from tests.test_train import _tiny_trainer
from tests.train_utils import (
    QWEN3_MOE_MODEL,
    kill_all,
    make_shards,
    pretrain_args,
    run_inprocess,
    run_torchrun,
    small_qwen3_moe_args,
    torchrun,
    wait_for_step,
)

transformers = pytest.importorskip("transformers")


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _assert_moe_metrics(record: dict, layers=(0, 1), num_experts: int = 4) -> None:
    """The aux loss and each sparse layer's load: fractions of the top-k choices."""
    assert 0 < record["aux_loss"] < 1, record["aux_loss"]
    worst = 0.0
    for layer in layers:
        low, high = record[f"expert_load_min/{layer}"], record[f"expert_load_max/{layer}"]
        assert 0 <= low <= 1 / num_experts <= high <= 1
        assert record[f"expert_load_max_mean/{layer}"] == pytest.approx(high * num_experts)
        worst = max(worst, record[f"expert_load_max_mean/{layer}"])
    assert record["expert_load_max_mean"] == worst


# ---- the loop against transformers ------------------------------------------------------------


class _CapturedGradients(torch.optim.SGD):
    """An optimizer that records the gradients it is handed and changes nothing."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads: list[dict[torch.Tensor, torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append({p: p.grad.clone() for g in self.param_groups for p in g["params"]})


def _hf_tiny_moe(directory: Path, coef: float):
    """A random Qwen3MoeForCausalLM (3 layers, the middle one dense, 6 experts, top-2), saved."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
        norm_topk_prob=True, router_aux_loss_coef=coef, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(20.0)  # top-k choices far from ties
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("coef", [0.001, 0.5])
def test_the_loop_adds_the_aux_loss_as_transformers_does(tmp_path, coef):
    """One micro-batch: the loop's gradient is transformers' (mean cross entropy + coef ×
    load balancing); two micro-batches: the step's token-mean cross entropy plus the mean of
    each micro-batch's own auxiliary loss (the loop's docstring)."""
    hf = _hf_tiny_moe(tmp_path / "hf", coef).train()
    tokens = torch.randint(0, 97, (4, 13), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((4, 1), IGNORE_INDEX)], dim=1)
    labels[0, :5] = IGNORE_INDEX  # an SFT-like prompt: fewer targets in one row

    out = hf(tokens, labels=_hf_labels(tokens, labels), output_router_logits=True)
    out.loss.backward()
    hf_router = hf.model.layers[2].mlp.gate.weight.grad
    hf_embed = hf.model.embed_tokens.weight.grad

    model = lmforge.load(tmp_path / "hf").model.train()
    optimizer = _CapturedGradients(model.parameters())
    batch = {"inputs": tokens, "labels": labels}
    trainer = _tiny_trainer(
        tmp_path, model, optimizer, causal_lm_loss, iter([batch]), max_grad_norm=0, steps=1
    )
    values = trainer.train_step(False)
    grads = optimizer.grads[-1]
    router = model.layers["2"].feed_forward.router.weight
    torch.testing.assert_close(grads[router], hf_router, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(grads[model.tok_embeddings.weight], hf_embed, atol=1e-6, rtol=1e-4)
    assert values["aux_loss"] == pytest.approx(coef * out.aux_loss.item(), rel=1e-5)
    assert values["loss"] == pytest.approx(out.loss.item() - coef * out.aux_loss.item(), rel=1e-5)
    assert sorted(k for k in values if k.startswith("expert_load_max/")) == [
        "expert_load_max/0",
        "expert_load_max/2",
    ]

    # Two micro-batches of two rows: CE over the step's targets + the mean of the two aux.
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    trainer = _tiny_trainer(
        tmp_path, model, optimizer, causal_lm_loss, iter(halves), max_grad_norm=0, steps=1
    )
    trainer.accum_steps = 2  # (as train.global_batch_size = 2 × micro_batch_size would)
    trainer.train_step(False)
    model.zero_grad()
    targets = (labels != IGNORE_INDEX).sum()
    total = 0.0
    auxes = []
    for half in halves:
        ce = causal_lm_loss(model, half).loss_sum / targets
        aux = model.aux_loss()
        auxes.append(aux.item())
        total = total + ce + aux / 2
    total.backward()
    torch.testing.assert_close(optimizer.grads[-1][router], router.grad, atol=1e-7, rtol=1e-5)
    assert auxes[0] != auxes[1]


def _hf_labels(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers shifts its labels itself: position t's label is the target of t - 1."""
    return torch.cat([torch.full((labels.shape[0], 1), IGNORE_INDEX), labels[:, :-1]], dim=1)


def test_no_grad_forwards_keep_the_trained_forwards_router_logits():
    """DPO's reference pass through the policy (adapters off) and rollouts run under no_grad:
    they leave the logits the aux loss reads alone."""
    model = build_model(small_qwen3_moe_args(), seed=0).train()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens)
    kept = model.router_logits()
    with torch.no_grad():
        model(tokens.flip(1))
    assert all(a is b for a, b in zip(kept, model.router_logits()))
    assert all(c.sum().item() == 2 * 9 * 2 for c in model.expert_counts().values())


# ---- DeepSeek-V3's auxiliary-loss-free balancing ------------------------------------------------


def test_the_selection_bias_chooses_and_the_probabilities_weigh():
    """route: the k largest of probabilities + bias are chosen, each weighted by its own
    probability (renormalized when norm_topk_prob); the bias is fp32 state that `.to(bf16)`
    and saving in bf16 leave fp32, and a step moves it by the rate against each expert's load."""
    from lmforge.models import moe

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    weights, experts = moe.route(logits, 2, norm_topk_prob=False, expert_bias=bias)
    assert sorted(experts[0].tolist()) == [0, 3]
    torch.testing.assert_close(weights[0][experts[0].argsort()], probs[0, [0, 3]])
    weights, _ = moe.route(logits, 2, norm_topk_prob=True, expert_bias=bias)
    assert weights.sum().item() == pytest.approx(1.0)
    assert moe.expert_counts(logits, 2, bias).tolist() == [1, 0, 0, 1]

    model = build_model(small_qwen3_moe_args(router_bias_update=0.25), seed=0)
    model = model.to(torch.bfloat16)
    mlp = model.layers["0"].feed_forward
    assert mlp.expert_bias.dtype == torch.float32 and not mlp.expert_bias.any()
    mlp.update_expert_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]), 0.25)  # mean 3
    assert mlp.expert_bias.tolist() == [-0.25, 0.25, 0.0, 0.0]
    assert "layers.0.feed_forward.expert_bias" in model.state_dict()
    assert "expert_bias" not in dict(build_model(small_qwen3_moe_args()).named_buffers())


def test_pretrain_moves_the_bias_and_the_artifact_keeps_it(tmp_path, data):
    """model.overrides.router_bias_update: each step every sparse layer's bias moves by the
    rate against its load (so the biases are multiples of it, some nonzero), the artifact
    saves them in fp32 under DeepSeek-V3's key with the rate in config.json, and lmforge loads
    them back; with no auxiliary loss the run still trains."""
    from safetensors.torch import load_file

    rate = 0.01
    args = ["model.overrides.router_bias_update=0.01", "model.overrides.router_aux_loss_coef=0"]
    assert run_inprocess("pretrain", moe_pretrain_args(tmp_path / "run", data, *args)) == 0
    records = _records(tmp_path / "run")
    assert records[5]["loss"] < records[1]["loss"] and records[1]["aux_loss"] == 0
    artifact = tmp_path / "run" / "artifact"
    config = json.loads((artifact / "config.json").read_text())
    assert config["router_bias_update"] == rate
    saved = load_file(artifact / "model.safetensors")
    bias = saved["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() <= 5 * rate + 1e-6
    steps = bias / rate
    assert bias.any() and torch.allclose(steps, steps.round(), atol=1e-4)
    loaded = lmforge.load(artifact, dtype=torch.bfloat16).model
    torch.testing.assert_close(loaded.layers["0"].feed_forward.expert_bias, bias)


# ---- pretraining: two FSDP2 processes, kill and resume ----------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("moe-data"))


def moe_pretrain_args(run_dir: Path, data, *extra: str) -> list[str]:
    tokenizer, shards = data
    dense = pretrain_args(run_dir, tokenizer, shards)
    return [a for a in dense if not a.startswith("model.")] + [
        f"model.tokenizer={tokenizer}",
        *QWEN3_MOE_MODEL,
        *extra,
    ]


def test_pretrain_two_fsdp_processes_match_one(tmp_path, data):
    """One row a micro-batch, so both layouts take each row's aux loss alone (the loop's
    docstring): FSDP2 (the experts' [E, ...] tensors sharded along dim 0) gives one process's
    losses, aux losses and loads. The artifact is a transformers Qwen3MoeForCausalLM."""
    one_args = ["train.micro_batch_size=1", "train.global_batch_size=2"]
    assert run_inprocess("pretrain", moe_pretrain_args(tmp_path / "one", data, *one_args)) == 0
    one = _records(tmp_path / "one")
    assert sorted(one) == [1, 2, 3, 4, 5] and one[5]["loss"] < one[1]["loss"]
    run_torchrun(2, "pretrain", moe_pretrain_args(tmp_path / "two", data, one_args[0]))
    two = _records(tmp_path / "two")
    for step, record in one.items():
        _assert_moe_metrics(record)
        for key in ("loss", "aux_loss", "grad_norm"):
            assert two[step][key] == pytest.approx(record[key], rel=1e-5, abs=1e-6), (step, key)
        for key in record:
            if key.startswith("expert_load"):
                assert two[step][key] == record[key], (step, key)
    artifact = tmp_path / "two" / "artifact"
    hf = transformers.AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts == 4
    tokens = torch.arange(1, 17)[None]
    ours = lmforge.load(artifact, dtype=torch.float32).model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-4, rtol=0)


def test_tensor_parallel_attention_matches_one_process(tmp_path, data):
    """parallel.tp = 2 splits attention over the two processes and keeps every MLP (router,
    stacked experts) replicated: the same rows give one process's losses, aux losses and
    loads."""
    args = ["train.micro_batch_size=1", "train.global_batch_size=2"]
    assert run_inprocess("pretrain", moe_pretrain_args(tmp_path / "one", data, *args)) == 0
    run_torchrun(2, "pretrain", moe_pretrain_args(tmp_path / "tp", data, *args, "parallel.tp=2"))
    one, tp = _records(tmp_path / "one"), _records(tmp_path / "tp")
    assert sorted(tp) == sorted(one)
    for step, record in one.items():
        for key in ("loss", "aux_loss", "grad_norm"):
            assert tp[step][key] == pytest.approx(record[key], rel=1e-5, abs=1e-6), (step, key)


def test_sigkill_then_resume_is_bit_identical(tmp_path, data):
    """Two FSDP2 processes killed mid-run resume from the last committed checkpoint: every
    step's loss, aux loss and expert loads equal the uninterrupted run's (DeepSeek-V3's
    selection bias on: the checkpoint carries it)."""
    args = ["train.steps=12", "checkpoint.every=4", "train.micro_batch_size=2"]
    args += ["model.overrides.router_bias_update=0.02"]
    run_torchrun(2, "pretrain", moe_pretrain_args(tmp_path / "reference", data, *args))
    reference = _records(tmp_path / "reference")
    run_dir = tmp_path / "killed"
    proc = torchrun(
        2,
        "pretrain",
        moe_pretrain_args(run_dir, data, *args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_step(run_dir, 6, proc)
    kill_all(proc)
    committed = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert int(committed[-1].split("-")[1]) in (4, 8), committed
    run_torchrun(2, "pretrain", moe_pretrain_args(run_dir, data, *args))
    resumed = _records(run_dir)
    assert sorted(resumed) == list(range(1, 13))
    moe_keys = [k for k in reference[1] if k == "aux_loss" or k.startswith("expert_load")]
    for step, record in resumed.items():
        for key in ("loss", "grad_norm", *moe_keys):
            assert record[key] == reference[step][key], (step, key)


# ---- SFT, DPO and GRPO through the CLI ----------------------------------------------------


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    return _base(tmp_path_factory.mktemp("post-moe"), tied=False, family="qwen3_moe")


def test_full_sft_logs_the_experts_load_everywhere(tmp_path, moe_base, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    args = full_sft_args(run_dir, moe_base, "metrics.tensorboard=true")
    assert run_inprocess("sft", args) == 0
    assert "expert load max/mean" in capsys.readouterr().err
    records = _records(run_dir)
    assert sorted(records) == [1, 2, 3, 4, 5] and records[5]["loss"] < records[1]["loss"]
    for record in records.values():
        _assert_moe_metrics(record)
    events = EventAccumulator(str(next((run_dir / "tensorboard").glob("events.*"))))
    tags = events.Reload().Tags()["scalars"]
    assert {"train/aux_loss", "train/expert_load_max_mean/1", "train/expert_load_min/0"} <= set(
        tags
    )
    config = json.loads((run_dir / "artifact" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 4


def test_sft_turns_the_bias_on_for_a_model_saved_without_one(tmp_path, moe_base, capsys):
    """A loaded model takes model.overrides.router_bias_update (its biases start at zero and
    move); an override of its shape is refused naming what a loaded model takes, and LoRA
    refuses the bias (an adapter cannot carry it): one line each, exit code 2."""
    from safetensors.torch import load_file

    on = "model.overrides.router_bias_update=0.02"
    assert run_inprocess("sft", full_sft_args(tmp_path / "run", moe_base, on)) == 0
    saved = load_file(tmp_path / "run" / "artifact" / "model.safetensors")
    bias = saved["model.layers.0.mlp.gate.e_score_correction_bias"]
    assert bias.any() and bias.abs().max() <= 0.02 * 10
    capsys.readouterr()
    shape = full_sft_args(tmp_path / "shape", moe_base, "model.overrides.num_experts=8")
    assert run_inprocess("sft", shape) == 2
    assert "router_aux_loss_coef, router_bias_update" in capsys.readouterr().err
    lora = full_sft_args(tmp_path / "lora", moe_base, on, "lora.enabled=true")
    assert run_inprocess("sft", lora) == 2
    assert "router_bias_update" in capsys.readouterr().err


def test_full_dpo_scores_against_a_frozen_moe_reference(tmp_path, moe_base):
    """The policy starts as its reference (rewards 0 at step 1), then moves away."""
    assert run_inprocess("dpo", full_dpo_args(tmp_path / "run", moe_base)) == 0
    records = _records(tmp_path / "run")
    assert sorted(records) == [1, 2, 3, 4, 5]
    assert records[1]["rewards_chosen"] == records[1]["rewards_rejected"] == 0
    assert records[1]["loss"] == pytest.approx(math.log(2))
    assert records[5]["reward_margin"] != 0
    for record in records.values():
        _assert_moe_metrics(record)


@pytest.fixture(scope="module")
def grpo_moe_world(tmp_path_factory):
    return _grpo_world(tmp_path_factory.mktemp("grpo-moe"), family="qwen3_moe")


def test_grpo_samples_on_the_engine_from_the_moe_being_trained(tmp_path, grpo_moe_world):
    """One process samples from the policy module; two FSDP2 processes from a gathered replica:
    the same first rollout batch and loss, and each step's engine log-probabilities equal the
    trainer's. (Later steps differ a little: the two layouts split a step's rows between
    micro-batches otherwise, and the aux term is each micro-batch's own; the loop's docstring.)"""
    args = ["train.steps=3", "grpo.beta=0.1"]  # full finetuning: a frozen MoE reference too
    assert run_inprocess("grpo", grpo_args(tmp_path / "one", grpo_moe_world, *args)) == 0
    one = _records(tmp_path / "one")
    assert sorted(one) == [1, 2, 3]
    for record in one.values():
        assert record["logprob_gap"] < 1e-4
        _assert_moe_metrics(record)
    assert one[1]["kl"] < 1e-9 < one[3]["kl"]
    many_args = [*args, "train.micro_batch_size=8"]
    run_torchrun(2, "grpo", grpo_args(tmp_path / "two", grpo_moe_world, *many_args))
    two = _records(tmp_path / "two")
    assert sorted(two) == [1, 2, 3]
    assert two[1]["reward"] == pytest.approx(one[1]["reward"], rel=1e-9)
    assert two[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-3, abs=1e-5)
    for record in two.values():
        assert record["logprob_gap"] < 1e-4  # the replica samples what the shards train
        _assert_moe_metrics(record)


# ---- the report ---------------------------------------------------------------------------


def test_report_draws_each_layers_load_spread():
    from lmforge.report import html

    records = [
        {"step": s, "loss": 3.0 / s, "expert_load_max_mean": 1.5 + s / 10,
         "expert_load_max_mean/0": 1.2 + s / 10, "expert_load_max_mean/3": 1.5 + s / 10}
        for s in range(1, 6)
    ]  # fmt: skip
    assert html.expert_load_layers(records) == [0, 3]
    figure = html._expert_load_figure("sft", records)
    assert figure.key == "experts_sft" and figure.png.startswith(b"\x89PNG")
    assert "2 sparse layers" in figure.caption and "1.60 → 2.00" in figure.caption
    assert html._expert_load_figure("sft", [{"step": 1, "loss": 2.0}]) is None
