"""LoRA and QLoRA on a Mixture-of-Experts model (a tiny Qwen3-MoE): adapters on the stacked
experts (`LoRAExperts`, per expert A [E, r, in] and B [E, out, r]) and on the router, in the
loop and the grouped paths alike, merged and disabled like `LoRALinear`s; the PEFT format both
ways against transformers' `Qwen3MoeForCausalLM` (PEFT adapts the experts and the router through
`target_parameters`); the NF4 base of the experts; and `lmforge sft` / `lmforge dpo` /
`lmforge merge` with experts as targets.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import lmforge
from lmforge import cli
from lmforge.api import build_model
from lmforge.errors import ConfigError, ModelFormatError
from lmforge.models import moe
from lmforge.modules import lora
from lmforge.sizes import module_bytes
from tests.test_post_training import _base, dpo_args, sft_args
from tests.test_qwen3_moe import make_hf_qwen3_moe
from tests.train_utils import losses, run_inprocess, small_args, small_qwen3_moe_args

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MOE_TARGETS = ["q", "v", "experts", "router"]
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
HF_TOKENS = torch.randint(0, 301, (3, 17), generator=torch.Generator().manual_seed(1))


def perturb_adapters(model, *, seed=1, std=0.05):
    """Non-zero values in every adapter tensor (B included), so that adapters change the
    output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def moe_lora_model(targets=("q", "experts", "router"), *, rank=4, alpha=8.0):
    model = build_model(small_qwen3_moe_args(), seed=0).eval()
    base = model(TOKENS).detach()
    lora.apply_lora(model, targets=list(targets), rank=rank, alpha=alpha)
    return model, base


def _set_grouped(model, grouped: bool) -> None:
    for module in model.modules():
        if isinstance(module, (lora.LoRAExperts, moe.Experts)):
            module.grouped = grouped


# ---- the module swap ------------------------------------------------------------------------


def test_expert_adapters_swap_train_merge_and_disable():
    model, base = moe_lora_model()
    experts = model.layers["0"].feed_forward.experts
    assert isinstance(experts, lora.LoRAExperts)
    assert isinstance(model.layers["0"].feed_forward.router, lora.LoRALinear)
    assert experts.lora_a["w13"].shape == (4, 4, 64) and experts.lora_b["w13"].shape == (4, 64, 4)
    assert experts.lora_a["w2"].shape == (4, 4, 32) and experts.lora_b["w2"].shape == (4, 64, 4)
    # B = 0: unchanged; base weights keep their names; only adapters train.
    torch.testing.assert_close(model(TOKENS), base, atol=0, rtol=0)
    names = set(model.state_dict())
    assert {"layers.0.feed_forward.experts.w13", "layers.0.feed_forward.router.weight"} <= names
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "layers.1.feed_forward.experts.lora_b.w2" in trainable
    assert all(".lora_" in n for n in trainable)
    assert lora.lora_base_names(model)[:4] == [
        "layers.0.attention.wq.weight",
        "layers.0.feed_forward.router.weight",
        "layers.0.feed_forward.experts.w13",
        "layers.0.feed_forward.experts.w2",
    ]

    perturb_adapters(model)
    _set_grouped(model, False)
    loop = model(TOKENS)
    assert (loop - base).abs().max() > 1e-3
    loop.square().mean().backward()
    loop_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    _set_grouped(model, True)  # the sorted rows through grouped products (base and adapters)
    grouped = model(TOKENS)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=0)
    grouped.square().mean().backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, loop_grads[name], atol=1e-5, rtol=1e-4)
    with torch.no_grad(), lora.disable_adapters(model):
        torch.testing.assert_close(model(TOKENS), base, atol=1e-6, rtol=0)
    with torch.no_grad():
        unmerged = model(TOKENS)
        lora.merge_lora(model)
        assert type(model.layers["0"].feed_forward.experts) is moe.Experts
        assert model.layers["0"].feed_forward.experts.grouped is True
        assert not lora.lora_modules(model)
        torch.testing.assert_close(model(TOKENS), unmerged, atol=1e-5, rtol=0)


def test_expert_targets_refuse_dropout_dense_models_and_dense_mlps_of_moes():
    with pytest.raises(ConfigError, match=r"lora\.dropout = 0\.1 with LoRA target"):
        lora.apply_lora(
            build_model(small_qwen3_moe_args()), targets=["experts"], rank=2, alpha=4, dropout=0.1
        )
    with pytest.raises(ConfigError, match="no linear layer of the model matches"):
        lora.apply_lora(build_model(small_args()), targets=["experts", "router"], rank=2, alpha=4)
    assert lora.LoRASection(targets=["q", "experts", "router"]).targets[-1] == "router"
    # PEFT on transformers 5 reads gate_proj / up_proj / down_proj of a MoE as the experts'.
    with_dense = build_model(small_qwen3_moe_args(mlp_only_layers=(1,)))
    with pytest.raises(ConfigError, match="down without the other MLP projections"):
        lora.apply_lora(with_dense, targets=["q", "down"], rank=2, alpha=4)


def test_default_targets_adapt_the_experts_and_frozen_experts_are_stored_in_base_dtype():
    """The default targets' gate / up / down mean a MoE's experts (as PEFT reads them); the
    dense layer among sparse ones takes none; experts left unadapted are frozen in base_dtype."""
    model = build_model(small_qwen3_moe_args(mlp_only_layers=(1,)))
    lora.apply_lora(model, targets=lora.DEFAULT_TARGETS, rank=2, alpha=4, base_dtype=torch.bfloat16)
    adapted = lora.lora_modules(model)
    assert isinstance(adapted["layers.0.feed_forward.experts"], lora.LoRAExperts)
    assert not any(".feed_forward.w" in name for name in adapted)  # the dense layer 1's MLP
    assert adapted["layers.0.feed_forward.experts"].w13.dtype == torch.bfloat16
    attention_only = build_model(small_qwen3_moe_args())
    lora.apply_lora(attention_only, targets=["q", "v"], rank=2, alpha=4, base_dtype=torch.bfloat16)
    experts = attention_only.layers["0"].feed_forward.experts
    assert type(experts) is moe.Experts
    assert experts.w13.dtype == experts.w2.dtype == torch.bfloat16
    assert not experts.w13.requires_grad
    assert lora.targets_for(["q", "gate", "up", "down"], moe_model=True) == ["q", "experts"]
    assert lora.targets_for(["q", "gate", "up", "down"], moe_model=False)[-1] == "down"


# ---- PEFT both ways ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A transformers Qwen3-MoE saved in the hub's per-expert layout (layer 1 dense)."""
    directory = tmp_path_factory.mktemp("hf-moe")
    make_hf_qwen3_moe(directory, norm_topk_prob=True, tie_word_embeddings=False)
    return directory


def test_peft_loads_our_moe_adapter_with_equal_logits(tmp_path, hf_moe):
    loaded = lmforge.load(hf_moe)
    cfg = lora.LoRASection(enabled=True, rank=4, alpha=8, targets=MOE_TARGETS)
    lora.apply_lora(loaded.model, targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha)
    perturb_adapters(loaded.model, std=0.02)
    adapter_dir = lora.save_peft_adapter(
        loaded.model, loaded.model.args, tmp_path / "adapter", base_model=str(hf_moe), lora_cfg=cfg
    )
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["target_parameters"] == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "mlp.gate.weight",
    ]
    from safetensors.torch import load_file

    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.mlp"
    assert tensors[f"{prefix}.experts.base_layer.lora_A.weight"].shape == (6 * 4, 96)  # gate_up
    assert tensors[f"{prefix}.experts.base_layer.lora_B.weight"].shape == (48, 4 * 6)
    assert tensors[f"{prefix}.experts.lora_A.weight"].shape == (6 * 4, 24)  # down
    assert tensors[f"{prefix}.gate.lora_B.weight"].shape == (6, 4)
    assert lora.read_peft_config(adapter_dir).targets == MOE_TARGETS

    with torch.no_grad():
        ours = loaded.model(HF_TOKENS)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_moe, dtype=torch.float32)
        peft_model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
        torch.testing.assert_close(peft_model(HF_TOKENS).logits, ours, atol=1e-5, rtol=0)
        peft_merged = peft_model.merge_and_unload()(HF_TOKENS).logits
        torch.testing.assert_close(peft_merged, ours, atol=1e-5, rtol=0)
        again = lmforge.load(hf_moe)  # and back into ours
        lora.load_peft_adapter(again.model, adapter_dir)
        torch.testing.assert_close(again.model(HF_TOKENS), ours, atol=1e-6, rtol=0)


def test_adapter_made_by_peft_on_transformers_loads_into_ours(tmp_path, hf_moe):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_moe, dtype=torch.float32)
    config = peft.LoraConfig(
        r=2,
        lora_alpha=6,
        target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
        task_type="CAUSAL_LM",
    )
    peft_model = peft.get_peft_model(hf, config)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:  # B non-zero, A away from its init: every layout matters
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(tmp_path / "peft_adapter")
    with torch.no_grad():
        expected = peft_model.eval()(HF_TOKENS).logits
    loaded = lmforge.load(hf_moe)
    cfg = lora.load_peft_adapter(loaded.model, tmp_path / "peft_adapter")
    assert cfg.targets == ["q", "o", "experts", "router"] and cfg.rank == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(HF_TOKENS), expected, atol=1e-5, rtol=0)

    # Half of the experts cannot be represented: the file is named.
    config_path = tmp_path / "peft_adapter" / "adapter_config.json"
    raw = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(raw | {"target_parameters": ["mlp.experts.down_proj"]}))
    with pytest.raises(ModelFormatError, match="adapts only part of the experts"):
        lora.read_peft_config(tmp_path / "peft_adapter")
    config_path.write_text(json.dumps(raw | {"target_parameters": ["mlp.shared.weight"]}))
    with pytest.raises(ModelFormatError, match=r"adapter_config\.json: target_parameters entry"):
        lora.read_peft_config(tmp_path / "peft_adapter")


# ---- QLoRA ----------------------------------------------------------------------------------


def test_qlora_stores_the_experts_as_nf4_and_trains_them():
    pytest.importorskip("torchao")
    model, _ = moe_lora_model()
    perturb_adapters(model, std=0.02)
    with torch.no_grad():
        full = model(TOKENS)
    before = module_bytes(model)
    lora.quantize_base_nf4(model)
    experts = model.layers["1"].feed_forward.experts
    assert lora.is_nf4(experts.w13) and lora.is_nf4(experts.w2)
    assert experts.base_weight("w13").shape == (4, 64, 64)
    assert module_bytes(model) < 0.7 * before
    summary = lora.nf4_summary(model)
    assert "layers.*.feed_forward.experts.w13, layers.*.feed_forward.experts.w2" in summary
    with torch.no_grad():
        quantized = model(TOKENS)
    assert (quantized - full).abs().max() < 0.1  # 4-bit bases: near, not equal
    for grouped in (False, True):  # both paths dequantize; gradients reach the adapters
        _set_grouped(model, grouped)
        model.zero_grad()
        model.train()
        model(TOKENS).square().mean().backward()
        assert experts.lora_b["w13"].grad.abs().sum() > 0
        assert experts.w13.grad is None
    lora.merge_lora(model)  # dequantized, then merged
    assert not lora.is_nf4(model.layers["1"].feed_forward.experts.w13)

    attention_only, _ = moe_lora_model(targets=("q",))
    lora.quantize_base_nf4(attention_only)
    assert "stacked experts without adapters stay in float32" in lora.nf4_summary(attention_only)


# ---- through the CLI ----------------------------------------------------------------------------

CLI_TARGETS = 'lora.targets=["q","k","v","o","experts","router"]'


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    return _base(tmp_path_factory.mktemp("moe-lora"), tied=False, family="qwen3_moe")


def test_sft_lora_on_experts_trains_exports_and_merges(tmp_path, moe_base):
    base_dir = moe_base[0]
    run_dir = tmp_path / "run"
    args = sft_args(run_dir, moe_base, CLI_TARGETS, "checkpoint.export_dtype=float32")
    assert run_inprocess("sft", args) == 0
    steps = losses(run_dir)
    assert sorted(steps) == [1, 2, 3, 4, 5] and steps[5] < steps[1]
    artifact, adapter = run_dir / "artifact", run_dir / "artifact" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert "mlp.experts.gate_up_proj" in config["target_parameters"]

    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    ours = lmforge.load(base_dir)  # lmforge's LoRA model: base + the trained adapter
    assert lora.load_peft_adapter(ours.model, adapter).targets[-2:] == ["experts", "router"]
    with torch.no_grad():
        with_adapter = ours.model(tokens)
        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(artifact).eval()
        torch.testing.assert_close(hf_merged(tokens).logits, with_adapter, atol=1e-5, rtol=0)
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
        with_peft = peft.PeftModel.from_pretrained(hf_base, adapter).eval()
        torch.testing.assert_close(with_peft(tokens).logits, with_adapter, atol=1e-5, rtol=0)
        baseline = lmforge.load(base_dir).model(tokens)
    assert (with_adapter - baseline).abs().max() > 1e-3  # training changed something

    out = tmp_path / "merged"
    assert cli.main(["merge", str(adapter), str(base_dir), str(out)]) == 0
    with torch.no_grad():
        torch.testing.assert_close(lmforge.load(out).model(tokens), with_adapter, atol=1e-5, rtol=0)


def test_dpo_lora_on_experts_uses_the_disabled_adapters_as_reference(tmp_path, moe_base):
    assert run_inprocess("dpo", dpo_args(tmp_path / "run", moe_base, CLI_TARGETS)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    first, last = records[0], records[-1]
    assert first["rewards_chosen"] == first["rewards_rejected"] == 0  # B = 0: policy = reference
    assert first["loss"] == pytest.approx(math.log(2))
    assert last["reward_margin"] != 0


def test_qlora_sft_on_experts_says_what_is_nf4(tmp_path, moe_base, caplog):
    pytest.importorskip("torchao")
    args = sft_args(tmp_path / "run", moe_base, CLI_TARGETS, "lora.quantize_base=nf4")
    with caplog.at_level(logging.WARNING):
        assert run_inprocess("sft", [*args, "train.steps=3"]) == 0
    assert "layers.*.feed_forward.experts.w13" in caplog.text
    steps = losses(tmp_path / "run")
    assert sorted(steps) == [1, 2, 3] and all(math.isfinite(v) for v in steps.values())


@pytest.mark.parametrize(
    ("method", "targets"),
    [
        ("lora", ("q", "experts", "router")),
        ("qlora", ("q", "experts", "router")),
        ("lora", ("q", "v")),
        ("lora", tuple(lora.DEFAULT_TARGETS)),
    ],
)
def test_dry_run_counts_the_expert_adapters_as_the_planner_does(method, targets):
    """Adapted, unadapted (frozen in bf16) and default-targeted (gate / up / down: the experts)."""
    from lmforge.plan import Setup, dry_run

    args = small_qwen3_moe_args(vocab_size=250, num_layers=3, mlp_only_layers=(1,))
    setup = Setup(args=args, gpus=2, method=method, lora_rank=4, lora_targets=targets)
    report = dry_run(setup)  # the meta-device model's tensors against param_specs
    assert report.mismatches == [] and report.matches


def test_the_plan_names_the_frozen_linears_dtype():
    """A LoRA plan's parameter row says the frozen linears are stored in lora.base_dtype (bf16
    here) beside the fp32 rest, not "fp32" for all of them."""
    from lmforge.models import get_preset
    from lmforge.plan import Setup, plan_memory
    from lmforge.plan.report import format_plan

    args = get_preset("qwen3-30b-a3b")
    lora_plan = format_plan(plan_memory(Setup(args=args, gpus=8, method="lora", lora_rank=4)))
    assert "parameters (frozen linears bf16, rest fp32, sharded 1/8)" in lora_plan
    full = format_plan(plan_memory(Setup(args=args, gpus=8, method="full")))
    assert "parameters (fp32, sharded 1/8)" in full


def test_a_lora_model_from_scratch_initializes_its_experts_and_adapters():
    """LoRA on a MoE trained from scratch: init_weights draws the frozen experts as a plain
    model's and fresh adapters (B zero, so the adapted model is the base at first)."""
    model = build_model(small_qwen3_moe_args(), dtype=torch.float32, seed=0)
    lora.apply_lora(model, targets=["experts"], rank=2, alpha=4)
    torch.manual_seed(1)
    model.init_weights()
    experts = model.layers["0"].feed_forward.experts
    assert isinstance(experts, lora.LoRAExperts)
    assert experts.w13.std() > 0 and experts.lora_a["w13"].abs().sum() > 0
    assert experts.lora_b["w13"].abs().sum() == 0


def test_lora_on_experts_under_ep2_matches_one_process(tmp_path, moe_base):
    """parallel.ep = 2 with LoRA on the experts (attention and the router too): each process
    holds two of the four experts and their adapters; one row a micro-batch (each micro-batch's
    aux loss its own), the same rows give one process's losses, and the exported adapter is
    the one process's. QLoRA with expert parallelism is refused in one line."""
    from safetensors.torch import load_file

    from tests.train_utils import run_torchrun

    common = [CLI_TARGETS, "train.micro_batch_size=1", "train.global_batch_size=2"]
    common += ["checkpoint.export_dtype=float32"]
    assert run_inprocess("sft", sft_args(tmp_path / "one", moe_base, *common)) == 0
    run_torchrun(2, "sft", sft_args(tmp_path / "ep", moe_base, *common, "parallel.ep=2"))
    one, ep = losses(tmp_path / "one"), losses(tmp_path / "ep")
    assert sorted(ep) == sorted(one) and one[max(one)] < one[1]
    for step, loss in one.items():
        assert ep[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    weights = "artifact/adapter/adapter_model.safetensors"
    ours, reference = load_file(tmp_path / "ep" / weights), load_file(tmp_path / "one" / weights)
    assert ours.keys() == reference.keys() and any("experts" in k for k in ours)
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, atol=2e-5, rtol=1e-4, msg=name)
    from lmforge.plan.memory import Setup, plan_memory

    args = lmforge.load(moe_base[0]).config
    with pytest.raises(ConfigError, match=r"QLoRA\) with parallel.ep > 1"):
        plan_memory(Setup(args=args, method="qlora", gpus=2, ep=2))
