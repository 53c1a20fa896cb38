"""examples/tiny_moe end to end, shortened (fewer people and steps): a tiny Qwen3-MoE pretrained,
SFT'd with LoRA on attention and the experts, quantized to compressed-tensors int8 / int4 and
evaluated; the int4 artifact loads in transformers as a Qwen3MoeForCausalLM with lmforge's
logits, and the report draws each training stage's expert load."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import tomli_w
import torch

import lmforge
from lmforge.launch.local import LocalLauncher
from lmforge.pipeline import load_pipeline, read_manifest, run_pipeline

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_moe" / "pipeline.toml"
STAGES = ["world", "tokenizer", "shards", "pretrain", "sft", "quantize_int8", "quantize_int4"]
STAGES.append("eval")
SPARSE_LAYERS = [1, 2, 3]  # mlp_only_layers = [0]


def shortened(file: Path, out: Path) -> Path:
    """The example with a smaller world and a few steps per training stage."""
    data = tomllib.loads(file.read_text())
    data["pipeline"]["name"] = "short_moe"
    stages = data["stages"]
    stages["world"]["demo"] = {"seed": 0, "num_people": 16, "repeats": 4}
    for name, steps in (("pretrain", 12), ("sft", 6)):
        stage = stages[name]
        stage["train"]["steps"] = steps
        stage["scheduler"]["warmup_steps"] = 1
        stage["metrics"]["log_every"] = 2
        stage["checkpoint"]["every"] = steps
    stages["pretrain"]["data"]["seq_len"] = 64
    stages["sft"]["train"].update(eval_every=3, micro_batch_size=4)
    out.write_text(tomli_w.dumps(data))
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("short_moe")
    pipeline = load_pipeline(shortened(EXAMPLE, workdir / "pipeline.toml"), workdir=workdir)
    lines: list[str] = []
    result = run_pipeline(pipeline, launcher=LocalLauncher(stream=None), echo=lines.append)
    assert result.ok, "\n".join(lines)
    return workdir / "runs" / "short_moe", pipeline


def test_the_example_is_a_tiny_qwen3_moe_with_a_dense_first_block(tmp_path):
    pipeline = load_pipeline(EXAMPLE, workdir=tmp_path)
    assert [s.name for s in pipeline.stages] == STAGES
    overrides = tomllib.loads(EXAMPLE.read_text())["model"]["overrides"]
    assert overrides["mlp_only_layers"] == [0] and overrides["num_experts"] == 8
    sft = pipeline.stage("sft").config
    assert sft.lora.enabled  # as the header says: LoRA, not full finetuning
    assert "LoRA on attention and on every" in EXAMPLE.read_text()


def test_every_stage_ran_and_the_experts_load_was_logged(finished):
    run_dir, _ = finished
    found = {name: read_manifest(run_dir / name) for name in STAGES}
    assert {m["status"] for m in found.values()} == {"succeeded"}
    pretrain = found["pretrain"]["metrics"]
    assert pretrain["step"] == 12 and pretrain["loss"] < pretrain["first_loss"]
    assert found["sft"]["input"]["hash"] == found["pretrain"]["output"]["hash"]
    for stage in ("pretrain", "sft"):
        records = [json.loads(line) for line in (run_dir / stage / "metrics.jsonl").open()]
        logged = [r for r in records if "expert_load_max_mean" in r]
        assert logged, stage
        keys = {k for r in logged for k in r if k.startswith("expert_load_max_mean/")}
        assert keys == {f"expert_load_max_mean/{layer}" for layer in SPARSE_LAYERS}, stage
        # max / mean of 8 experts' shares: 1 (balanced) to 8 / 2 (always the same two)
        assert all(1.0 <= r["expert_load_max_mean"] <= 4.0 + 1e-6 for r in logged), stage

    # the adapter: attention as modules, the stacked experts as parameters (PEFT's layout)
    adapter = json.loads((run_dir / "sft/artifact/adapter/adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(
        adapter["target_parameters"]
    )
    assert not any("gate.weight" in p for p in adapter["target_parameters"])  # router frozen

    assert found["quantize_int8"]["metrics"]["scheme"] == "int8-wo"
    assert found["quantize_int4"]["metrics"]["scheme"] == "int4-wo"
    evaluated = found["eval"]["metrics"]
    assert list(evaluated) == ["base", "sft", "int8", "int4"]
    for label, metrics in evaluated.items():
        keys = {"demo_mc/acc", "demo_mc_chat/acc", "preference/accuracy", "answers/exact_match"}
        assert keys <= set(metrics), label
        assert all(0.0 <= metrics[key] <= 1.0 for key in keys), label


def test_the_int4_artifact_loads_in_transformers_with_lmforges_logits(finished):
    """compressed-tensors W4A16 covers every expert under the hub's per-expert names and leaves
    the router: transformers builds a Qwen3MoeForCausalLM from it, block 0 dense."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run_dir, _ = finished
    artifact = run_dir / "quantize_int4" / "artifact"
    keys = set()
    for file in artifact.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    for layer in SPARSE_LAYERS:
        assert f"model.layers.{layer}.mlp.experts.7.down_proj.weight_packed" in keys
        assert f"model.layers.{layer}.mlp.gate.weight" in keys  # the router as it was
    assert "model.layers.0.mlp.down_proj.weight_packed" in keys  # the dense block

    theirs = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32)
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    assert (theirs.config.num_experts, theirs.config.mlp_only_layers) == (8, [0])
    ours = lmforge.load(artifact, dtype="float32").model
    tokens = torch.tensor([[1, 5, 9, 20, 33, 7, 100, 3]])
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    # the same dequantized weights; summed in another order (relative 1e-4 here)
    assert ((got - want).norm() / want.norm()).item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_report_draws_each_training_stages_expert_load(finished):
    run_dir, _ = finished
    page = (run_dir / "report.html").read_text()
    for stage in ("pretrain", "sft"):
        figure = re.search(
            rf'<figure id="fig-experts_{stage}">(.*?)</figure>', page, flags=re.DOTALL
        )
        assert figure, stage
        assert 'src="data:image/png;base64,' in figure.group(1)
        assert "3 sparse layers; worst layer" in figure.group(1)
    assert (run_dir / "report_assets" / "experts_pretrain.png").exists()
