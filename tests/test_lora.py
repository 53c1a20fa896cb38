"""LoRA / QLoRA (lmforge.modules.lora): the module swap, merge, disable, PEFT interop, `lmforge
merge`, and the NF4 base.

PEFT parity: our adapter, saved for a base artifact written by `lmforge.save`, is loaded by the
`peft` library onto transformers' LlamaForCausalLM; its logits (and its merge_and_unload model's)
must equal our merged model's to 1e-5, and an adapter made by `peft` must load into ours.
"""

from __future__ import annotations

import json

import pytest
import torch

import lmforge
from lmforge import cli
from lmforge.api import LoadedModel, build_model
from lmforge.config import load_config
from lmforge.errors import ConfigError, ModelFormatError
from lmforge.models import Transformer
from lmforge.modules import lora
from lmforge.sizes import module_bytes, tensor_bytes
from tests.conftest import make_hf_llama, make_hf_qwen3
from tests.train_utils import small_args, small_qwen3_args

ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down", "output"]
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def perturb_adapters(model, *, seed=1, std=0.05):
    """Non-zero B (and a fresh A) so that adapters change the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora.lora_modules(model).values():
            for linear in (module.lora_a, module.lora_b):
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * std)


def lora_model(targets=ALL_TARGETS, *, rank=4, alpha=8.0, seed=0):
    model = build_model(small_args(), seed=seed)
    base_logits = model(TOKENS).detach()
    lora.apply_lora(model, targets=targets, rank=rank, alpha=alpha, dropout=0.0)
    return model, base_logits


# ---- the module swap ------------------------------------------------------------------------


def test_zero_b_leaves_logits_unchanged_and_keeps_state_dict_names():
    base = build_model(small_args())
    base_names = set(base.state_dict())
    model, base_logits = lora_model()
    assert torch.equal(model(TOKENS), base_logits)
    adapted = set(model.state_dict())
    assert base_names <= adapted
    assert adapted - base_names == set(lora.lora_state_dict(model))
    assert "layers.0.attention.wq.lora_a.weight" in adapted
    assert len(lora.lora_modules(model)) == 2 * 7 + 1
    wq = model.layers["0"].attention.wq
    assert wq.lora_a.weight.shape == (4, 64) and wq.lora_b.weight.shape == (64, 4)
    assert wq.scale == 2.0 and not wq.lora_b.weight.any() and wq.lora_a.weight.any()


def test_merged_model_equals_unmerged_forward():
    model, base_logits = lora_model()
    perturb_adapters(model)
    adapted = model(TOKENS).detach()
    assert (adapted - base_logits).abs().max() > 1e-2  # the adapters do something
    lora.merge_lora(model)
    assert not lora.lora_modules(model)
    assert isinstance(model.layers["1"].feed_forward.w2, torch.nn.Linear)
    assert set(model.state_dict()) == set(build_model(small_args()).state_dict())
    torch.testing.assert_close(model(TOKENS), adapted, atol=1e-5, rtol=0)


def test_disable_adapters_gives_base_logits():
    model, base_logits = lora_model()
    perturb_adapters(model)
    adapted = model(TOKENS).detach()
    with lora.disable_adapters(model):
        assert torch.equal(model(TOKENS), base_logits)
    assert torch.equal(model(TOKENS), adapted)


def test_only_adapters_train():
    model, _ = lora_model(targets=["q", "v", "down"])
    perturb_adapters(model)  # B != 0 so A gets gradients too
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora.lora_state_dict(model))
    assert len(trainable) == 2 * 3 * 2
    before = {n: t.clone() for n, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)
    model.train()
    logits = model(TOKENS[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), TOKENS[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    for name, tensor in model.state_dict().items():
        changed = not torch.equal(tensor, before[name])
        assert changed == (name in trainable), name


def test_dropout_only_in_training():
    model = build_model(small_args())
    lora.apply_lora(model, targets=["q"], rank=4, alpha=8, dropout=0.5)
    perturb_adapters(model)
    model.eval()
    assert torch.equal(model(TOKENS), model(TOKENS))
    model.train()
    assert not torch.equal(model(TOKENS), model(TOKENS))


def test_meta_device_then_to_empty_and_reset():
    args = small_args()
    base = build_model(args, seed=3)
    with torch.device("meta"):
        model = Transformer(args)
    lora.apply_lora(model, targets=ALL_TARGETS, rank=4, alpha=8)
    assert model.layers["0"].attention.wq.lora_a.weight.is_meta
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    model.load_state_dict(base.state_dict(), strict=False)
    lora.reset_lora_parameters(model)
    assert torch.equal(model(TOKENS), base(TOKENS))
    for module in lora.lora_modules(model).values():
        assert not module.lora_b.weight.any()
        assert module.lora_a.weight.abs().max() <= 1 / module.in_features**0.5  # kaiming bound
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(
        lora.lora_state_dict(model)
    )


def test_bad_targets_and_tied_output_are_config_errors():
    model = build_model(small_args())
    with pytest.raises(ConfigError, match=r"'qq'.*allowed: q, k, v, o, gate, up, down, output"):
        lora.apply_lora(model, targets=["q", "qq"], rank=4, alpha=8)
    tied = build_model(small_args(tie_embeddings=True))
    with pytest.raises(ConfigError, match="tied embeddings"):
        lora.apply_lora(tied, targets=["q", "output"], rank=4, alpha=8)
    with pytest.raises(ConfigError, match=r"targets.*'w1'.*allowed: q, k"):
        load_config(lora.LoRASection, None, ['targets=["q", "w1"]'])
    cfg = load_config(lora.LoRASection, None, ["rank=16", "quantize_base=nf4"])
    assert cfg.rank == 16 and cfg.targets == lora.DEFAULT_TARGETS


# ---- PEFT interop and `lmforge merge` ------------------------------------------------------


def _save_lora(root, args):
    """A base artifact (lmforge.save), our adapter for it, and our logits before/after merge."""
    base = build_model(args, seed=5)
    base_dir = lmforge.save(LoadedModel(base, None, args, "tiny"), root / "base")
    cfg = lora.LoRASection(enabled=True, rank=4, alpha=8, targets=ALL_TARGETS)
    lora.apply_lora(base, targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha)
    perturb_adapters(base)
    adapter_dir = lora.save_peft_adapter(
        base, args, root / "adapter", base_model=str(base_dir), lora_cfg=cfg
    )
    unmerged = base(TOKENS).detach()
    merged = lora.merge_lora(base)(TOKENS).detach()
    return base_dir, adapter_dir, unmerged, merged


@pytest.fixture(scope="module")
def saved_lora(tmp_path_factory):
    return _save_lora(tmp_path_factory.mktemp("lora"), small_args())


@pytest.fixture(scope="module")
def saved_qwen3_lora(tmp_path_factory):
    """The same for a Qwen3 (untied, so that the output projection takes an adapter too)."""
    args = small_qwen3_args(tie_embeddings=False)
    return _save_lora(tmp_path_factory.mktemp("lora-qwen3"), args)


def test_adapter_files_use_peft_layout(saved_lora):
    from safetensors.torch import load_file

    base_dir, adapter_dir, _, _ = saved_lora
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["base_model_name_or_path"] == str(base_dir)
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    )
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (4, 128)
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (256, 4)
    assert len(tensors) == 2 * (2 * 7 + 1)


@pytest.mark.parametrize("saved", ["saved_lora", "saved_qwen3_lora"], ids=["llama", "qwen3"])
def test_peft_loads_our_adapter_with_equal_logits(request, saved):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base_dir, adapter_dir, unmerged, merged = request.getfixturevalue(saved)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        peft_logits = peft_model(TOKENS).logits
        torch.testing.assert_close(peft_logits, merged, atol=1e-5, rtol=0)
        peft_merged = peft_model.merge_and_unload()(TOKENS).logits
    torch.testing.assert_close(peft_merged, merged, atol=1e-5, rtol=0)


def test_load_our_adapter_into_a_loaded_base(saved_lora):
    base_dir, adapter_dir, unmerged, _ = saved_lora
    loaded = lmforge.load(base_dir)
    cfg = lora.load_peft_adapter(loaded.model, adapter_dir)
    assert cfg.rank == 4 and cfg.alpha == 8 and cfg.targets == ALL_TARGETS
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(TOKENS), unmerged, atol=1e-6, rtol=0)


@pytest.mark.parametrize("make_hf", [make_hf_llama, make_hf_qwen3], ids=["llama", "qwen3"])
def test_adapter_made_by_peft_loads_into_ours(tmp_path, make_hf):
    peft = pytest.importorskip("peft")
    hf = make_hf(tmp_path / "hf", tie_word_embeddings=False, vocab_size=256)
    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["q_proj", "o_proj", "up_proj"], task_type="CAUSAL_LM"
    )
    peft_model = peft.get_peft_model(hf, config)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(tmp_path / "peft_adapter")
    with torch.no_grad():
        expected = peft_model.eval()(TOKENS).logits
    loaded = lmforge.load(tmp_path / "hf")
    lora.load_peft_adapter(loaded.model, tmp_path / "peft_adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(TOKENS), expected, atol=1e-5, rtol=0)


def test_bad_adapters_name_the_file(tmp_path, saved_lora):
    import shutil

    _, adapter_dir, _, _ = saved_lora
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(ModelFormatError, match=r"bad/adapter_config.json: use_dora = true"):
        lora.load_peft_adapter(build_model(small_args()), bad)
    (bad / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["qkv"]}))
    with pytest.raises(ModelFormatError, match=r"adapter_config.json: target_modules.*q_proj"):
        lora.read_peft_config(bad)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    wider = build_model(small_args(dim=128, ffn_dim=256))
    with pytest.raises(ModelFormatError, match=r"adapter_model.safetensors: tensor .* shape"):
        lora.load_peft_adapter(wider, bad)


def test_merge_command_round_trip(tmp_path, saved_lora, capsys):
    base_dir, adapter_dir, _, merged = saved_lora
    out = tmp_path / "merged"
    assert cli.main(["merge", str(adapter_dir), str(base_dir), str(out)]) == 0
    loaded = lmforge.load(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(TOKENS), merged, atol=1e-5, rtol=0)
    lineage = json.loads((out / "lmforge.json").read_text())
    assert lineage["stage"] == "merge"
    assert lineage["parent"]["source"] == str(base_dir)
    assert lineage["parent"]["hash"] == json.loads((base_dir / "lmforge.json").read_text())["hash"]
    assert lineage["config"]["lora"]["rank"] == 4 and lineage["config"]["adapter_hash"]
    assert not (out / "adapter_config.json").exists()

    (tmp_path / "empty").mkdir()
    assert cli.main(["merge", str(tmp_path / "empty"), str(base_dir), str(tmp_path / "x")]) == 2
    assert "adapter_config.json: file not found" in capsys.readouterr().err


# ---- QLoRA: NF4 base ----------------------------------------------------------------------


def test_qlora_nf4_base_forward_memory_and_training():
    pytest.importorskip("torchao")
    args = small_args(dim=128, ffn_dim=256)
    model = build_model(args, seed=7)
    lora.apply_lora(model, targets=lora.DEFAULT_TARGETS, rank=8, alpha=16)
    full_logits = model(TOKENS).detach()
    full_bytes = module_bytes(model)
    base_linear_bytes = sum(tensor_bytes(m.weight) for m in lora.lora_modules(model).values())
    base_wq = model.layers["0"].attention.wq.weight.detach().clone()
    lora.quantize_base_nf4(model)
    wq = model.layers["0"].attention.wq
    assert lora.is_nf4(wq.weight) and not wq.weight.requires_grad

    # Forward close to the fp32 base. Measured on this model (seed 7): the NF4 weight's relative
    # error (L2) is 0.092, the logits' relative error 0.116 (max abs 0.11 for logits of max abs
    # 1.07), KL(fp32 || nf4) of the next-token distributions 3.2e-4 nats; bounds with margin.
    dense = wq.weight.get_original_weight()
    assert (dense - base_wq).norm() / base_wq.norm() < 0.11
    nf4_logits = model(TOKENS).detach()
    assert (nf4_logits - full_logits).norm() / full_logits.norm() < 0.15
    log_p, log_q = full_logits.log_softmax(-1), nf4_logits.log_softmax(-1)
    assert (log_p.exp() * (log_p - log_q)).sum(-1).mean() < 1e-3

    # Memory: the adapted linears' base weights shrink from 4 bytes to 0.52 per weight (4-bit
    # codes + double-quantized scales): measured 0.130x; the whole model 0.348x (fp32 embedding
    # and output head kept), 0.276x with the output head in NF4 too.
    nf4_linear_bytes = sum(tensor_bytes(m.weight) for m in lora.lora_modules(model).values())
    assert nf4_linear_bytes / base_linear_bytes < 0.135
    assert module_bytes(model) / full_bytes < 0.36
    lora.quantize_base_nf4(model, include_frozen_linears=True)  # the output head too
    assert lora.is_nf4(model.output.weight)
    assert module_bytes(model) / full_bytes < 0.28

    # Adapters train on a fixed batch; only they get gradients, the NF4 base stays as it was.
    codes = wq.weight.quantized_data.clone()
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=3e-3, weight_decay=0.0)
    inputs, labels = TOKENS[:, :-1], TOKENS[:, 1:]
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == set(lora.lora_state_dict(model))
    assert losses[-1] < losses[0] - 0.1, losses
    assert torch.equal(wq.weight.quantized_data, codes)

    # Merging dequantizes: the merged model matches the NF4 + adapter forward.
    adapted = model(TOKENS).detach()
    lora.merge_lora(model)
    assert not lora.is_nf4(model.layers["0"].attention.wq.weight)
    model.output.weight = torch.nn.Parameter(model.output.weight.get_original_weight())
    torch.testing.assert_close(model(TOKENS), adapted, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_frozen_linears_give_the_same_autocast_forward(tied):
    args = small_args(tie_embeddings=tied)
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    fp32 = lora.apply_lora(build_model(args, seed=0), targets=targets, rank=4, alpha=8)
    perturb_adapters(fp32)
    half = lora.apply_lora(
        build_model(args, seed=5), targets=targets, rank=4, alpha=8, base_dtype=torch.bfloat16
    )
    half.load_state_dict(fp32.state_dict())
    dtypes = {name: p.dtype for name, p in half.named_parameters()}
    for name, dtype in dtypes.items():
        frozen_linear = name.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight",
                                       "w1.weight", "w2.weight", "w3.weight"))  # fmt: skip
        frozen_linear |= name == "output.weight" and not tied  # tied: it is the embedding
        assert dtype == (torch.bfloat16 if frozen_linear else torch.float32), name
    assert [n for n, p in half.named_parameters() if p.requires_grad] == [
        n for n, p in fp32.named_parameters() if p.requires_grad
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the matmuls read bf16 weights anyway
        assert torch.equal(half(TOKENS), fp32(TOKENS))
    stored_bf16 = sum(p.numel() for p in half.parameters() if p.dtype == torch.bfloat16)
    assert module_bytes(fp32) - module_bytes(half) == 2 * stored_bf16


def test_nf4_bases_shard_only_in_whole_scale_groups():
    pytest.importorskip("torchao")
    with torch.device("meta"):
        wide = lora.apply_lora(
            Transformer(small_args(dim=256, ffn_dim=512)), targets=["q"], rank=4, alpha=8
        )
        narrow = lora.apply_lora(Transformer(small_args()), targets=["q"], rank=4, alpha=8)
    lora.nf4_placeholders(wide, num_shards=2)
    assert lora.is_nf4(wide.layers["0"].attention.wq.weight)
    with pytest.raises(
        ConfigError, match=r"layers\.0\.attention\.wq\.weight \(64, 64\) does not split"
    ):
        lora.nf4_placeholders(narrow, num_shards=2)


def test_a_target_that_names_no_module_is_refused_not_skipped():
    """A dense model has no router: "router" beside real targets is an error naming it."""
    model = build_model(small_args(), seed=0)
    with pytest.raises(ConfigError, match=r"LoRA target\(s\) router name no module .* q, v\)"):
        lora.apply_lora(model, targets=["q", "v", "router"], rank=4, alpha=8.0)
    assert not lora.lora_modules(model)  # nothing was swapped
