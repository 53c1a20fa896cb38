"""The Qwen3-MoE family: preset parameter counts (total and active) against transformers, logits
parity with `Qwen3MoeForCausalLM` on odd shapes (a dense layer among sparse ones, renormalized
and raw top-k weights, tied and untied), the hub's per-expert files and transformers 5's stacked
layout both read, the export transformers loads back, greedy tokens through the one engine, the
experts' loop and grouped paths, the load-balancing loss against transformers', and the
planner.
"""

from __future__ import annotations

import json

import pytest
import torch

import lmforge
from lmforge import artifact, cli, models
from lmforge.errors import ConfigError, ModelFormatError
from lmforge.generate import Generator, SamplingParams
from lmforge.models import moe
from lmforge.models.qwen3_moe import hf as moe_hf

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")

# Odd on purpose: head_dim 40 (not hidden / heads), 6 experts of width 24, top-2, layer 1 dense.
SHAPE = dict(
    vocab_size=301,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=40,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
)
VARIANTS = {
    "norm-untied": dict(norm_topk_prob=True, tie_word_embeddings=False),
    "raw-tied": dict(norm_topk_prob=False, tie_word_embeddings=True),
    "raw-untied-step2": dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[]),
}


def make_hf_qwen3_moe(directory, *, seed: int = 0, save_original_format: bool = True, **changes):
    """A random Qwen3MoeForCausalLM saved to `directory`: norms away from one, and routers
    scaled up so that each token's top-k choice is far from a tie."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**(SHAPE | changes)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.mul_(50.0)
    model = model.eval()
    model.save_pretrained(directory, save_original_format=save_original_format)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_moe(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / request.param
    return directory, make_hf_qwen3_moe(directory, **VARIANTS[request.param])


def _tokens(vocab_size: int = 301, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (3, 29), generator=torch.Generator().manual_seed(seed))


# ---- presets ------------------------------------------------------------------------------

PUBLISHED = {  # hidden, layers, heads, kv heads, moe_intermediate, intermediate; -> B total, active
    "qwen3-30b-a3b": ((2048, 48, 32, 4, 768, 6144), (30.5, 3.35)),
    "qwen3-235b-a22b": ((4096, 94, 64, 4, 1536, 12288), (235.1, 22.19)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_equal_transformers(name):
    (hidden, layers, heads, kv_heads, moe_ffn, ffn), (total, active) = PUBLISHED[name]
    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        moe_intermediate_size=moe_ffn,
        intermediate_size=ffn,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=151936,
        tie_word_embeddings=False,
    )
    args = models.get_preset(name)
    with torch.device("meta"):
        theirs = transformers.Qwen3MoeForCausalLM(config)
        ours = models.new_model(args)
    expected = sum(p.numel() for p in theirs.parameters())
    assert args.num_params() == expected == sum(p.numel() for p in ours.parameters())
    assert round(args.num_params() / 1e9, 1) == total
    assert round(args.num_params(active=True) / 1e9, 2) == active
    assert (args.max_seq_len, args.rope_theta, args.norm_topk_prob) == (40960, 1e6, True)
    config_json = models.args_to_hf_config(args, torch.bfloat16)
    assert models.args_from_hf_config(config_json, "config.json") == args
    assert transformers.Qwen3MoeConfig(**config_json).num_experts == 128


def test_sparse_layers_follow_transformers_rule():
    for changes in (dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2, mlp_only_layers=[])):
        config = transformers.Qwen3MoeConfig(**(SHAPE | changes))
        theirs = modeling.Qwen3MoeForCausalLM(config)
        path = "config.json"
        args = models.args_from_hf_config(json.loads(config.to_json_string()), path)
        with torch.device("meta"):
            ours = models.new_model(args)
        sparse = [
            isinstance(layer.mlp, modeling.Qwen3MoeSparseMoeBlock) for layer in theirs.model.layers
        ]
        assert sparse == [
            isinstance(b.feed_forward, moe.MoEFeedForward) for b in ours.layers.values()
        ]
        assert sparse == [args.is_moe_layer(i) for i in range(args.num_layers)]


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(num_experts_per_tok=7), "num_experts_per_tok=7 must be <= num_experts=6"),
        (dict(mlp_only_layers=(3,)), "mlp_only_layers=\\(3,\\) must list layer indices"),
        (dict(moe_ffn_dim=0), "moe_ffn_dim=0 must be > 0"),
        (dict(decoder_sparse_step=1.5), "decoder_sparse_step=1.5 must be an integer"),
        (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef=-1.0 must be a number >= 0"),
        (dict(router_bias_update="fast"), "router_bias_update='fast' must be a number >= 0"),
    ],
)
def test_bad_fields_are_config_errors_naming_the_field(change, field):
    args = models.get_preset("qwen3-30b-a3b").replace(
        num_layers=3, num_experts=6, num_experts_per_tok=2
    )
    with pytest.raises(ConfigError, match=field):
        args.replace(**change)


# ---- Hugging Face parity ------------------------------------------------------------------


def test_logits_match_transformers(hf_moe):
    directory, hf_model = hf_moe
    loaded = lmforge.load(directory)
    assert loaded.config.family == "qwen3_moe" and loaded.config.num_experts == 6
    tokens = _tokens()
    with torch.no_grad():
        ours = loaded.model(tokens)
        theirs = hf_model(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    for block in loaded.model.layers.values():  # the grouped path gives the same logits
        if isinstance(block.feed_forward, moe.MoEFeedForward):
            block.feed_forward.experts.grouped = True
    with torch.no_grad():
        assert (loaded.model(tokens) - theirs).abs().max().item() <= 1e-5


def test_export_writes_the_hubs_keys_and_loads_in_transformers(hf_moe, tmp_path):
    directory, hf_model = hf_moe
    out = lmforge.save(lmforge.load(directory), tmp_path / "exported")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == [
        "Qwen3MoeForCausalLM"
    ]
    original = artifact.read_safetensors(directory)
    exported = artifact.read_safetensors(out)
    if hf_model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    sparse = models.args_from_hf_config(config, out).moe_layers[0]
    assert f"model.layers.{sparse}.mlp.experts.5.up_proj.weight" in exported
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    tokens = _tokens(seed=2)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf_model(tokens).logits)


def test_reads_transformers_stacked_layout(tmp_path):
    directory = tmp_path / "stacked"
    hf_model = make_hf_qwen3_moe(directory, seed=3, save_original_format=False, norm_topk_prob=True)
    stored = artifact.read_safetensors(directory)
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 48, 96)
    loaded = lmforge.load(directory)
    tokens = _tokens(seed=3)
    with torch.no_grad():
        assert (loaded.model(tokens) - hf_model(tokens).logits).abs().max().item() <= 1e-5


def test_a_missing_expert_names_its_tensor(tmp_path):
    make_hf_qwen3_moe(tmp_path / "m")
    state = artifact.read_safetensors(tmp_path / "m")
    del state["model.layers.0.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ModelFormatError, match=r"layers\.0\.mlp\.experts\.3\.up_proj\.weight"):
        moe_hf.stack_experts(state, tmp_path)


def test_greedy_tokens_equal_transformers_generate(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # decode is many tiny matmuls
    try:
        hf_model = make_hf_qwen3_moe(tmp_path / "m", seed=4, norm_topk_prob=True)
        hf_model.generation_config.eos_token_id = None  # exactly max_new_tokens
        loaded = lmforge.load(tmp_path / "m")
        prompts = [
            torch.randint(0, 301, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (5, 11, 1)
        ]
        params = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=())
        results = Generator(loaded.model, max_batch=2, max_seq_len=64).generate(prompts, params)
        for prompt, result in zip(prompts, results.results, strict=True):
            expected = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
            assert result.token_ids == expected
    finally:
        torch.set_num_threads(threads)


def test_a_decode_step_reads_the_chosen_experts_only(tmp_path):
    """`weight_bytes` (what generate's GB/s and decode.py's limit divide by) counts a MoE
    block's stacked experts at k of E: the bytes one token's step reads."""
    from lmforge.generate.generate import weight_bytes
    from lmforge.sizes import tensor_bytes

    make_hf_qwen3_moe(tmp_path / "m", seed=4)
    model = lmforge.load(tmp_path / "m").model
    stacks = [b.feed_forward.experts for b in model.layers.values()
              if isinstance(b.feed_forward, moe.MoEFeedForward)]  # fmt: skip
    assert stacks
    experts = sum(tensor_bytes(p) for stack in stacks for p in stack.parameters())
    share = model.args.num_experts_per_tok / model.args.num_experts
    everything = sum(tensor_bytes(p) for p in model.parameters())
    table = tensor_bytes(model.tok_embeddings.weight)  # looked up, not read whole (untied)
    assert weight_bytes(model) == everything - table - round(experts * (1 - share))


# ---- the experts' two paths and the load-balancing loss ------------------------------------


def _routed(tokens: int, dim: int, ffn: int, num_experts: int, top_k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    w13 = torch.randn(num_experts, 2 * ffn, dim, generator=g) / dim**0.5
    w2 = torch.randn(num_experts, dim, ffn, generator=g) / ffn**0.5
    # Expert 0 chosen by nobody: an empty group in the middle of the offsets.
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, 0] = -1e4
    weights, experts = moe.route(logits, top_k, norm_topk_prob=True)
    return x, w13, w2, weights, experts


@pytest.mark.parametrize(
    "shape", [(37, 96, 24, 6, 2), (5, 32, 8, 8, 3), (1, 96, 24, 6, 1)], ids=str
)
@pytest.mark.parametrize("use_grouped_mm", [True, False], ids=["grouped_mm", "offset-loop"])
def test_grouped_path_equals_the_loop(shape, use_grouped_mm):
    x, w13, w2, weights, experts = _routed(*shape)
    params = [t.requires_grad_() for t in (x, w13, w2)]
    reference = moe.experts_loop(x, w13, w2, weights, experts)
    grads = torch.autograd.grad(reference, params, torch.ones_like(reference))
    grouped = moe.experts_grouped(x, w13, w2, weights, experts, use_grouped_mm=use_grouped_mm)
    torch.testing.assert_close(grouped, reference, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(torch.autograd.grad(grouped, params, torch.ones_like(grouped)), grads):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_grouped_path_under_autocast_takes_the_grouped_product(monkeypatch):
    """fp32 rows, weights and adapters under bf16 autocast (LoRA on one GPU): cast as autocast
    casts a linear, so every product is one `_grouped_mm` (no per-expert fallback and its host
    syncs), equal to the loop under the same autocast; the fp32 adapters get gradients."""
    x, w13, w2, weights, experts = _routed(37, 96, 24, 6, 2)
    rank, g = 8, torch.Generator().manual_seed(3)
    lora = moe.ExpertAdapters(
        *(torch.randn(6, *shape, generator=g).mul_(0.1).requires_grad_()
          for shape in ((rank, 96), (48, rank), (rank, 24), (96, rank))),
        scale=2.0,
    )  # fmt: skip
    products = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(
        torch, "_grouped_mm", lambda *a, **k: products.append(1) or grouped_mm(*a, **k)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = moe.experts_loop(x, w13, w2, weights, experts, lora)
        assert not products
        grouped = moe.experts_grouped(x, w13, w2, weights, experts, lora)
    assert len(products) == 6  # w13, w2 and two per projection for the adapters
    assert grouped.dtype == torch.bfloat16
    torch.testing.assert_close(grouped.float(), reference.float(), atol=0.05, rtol=0.05)
    grouped.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (lora.a13, lora.b2))


def test_router_and_experts_equal_transformers_block():
    for norm in (True, False):
        config = transformers.Qwen3MoeConfig(**(SHAPE | dict(norm_topk_prob=norm)))
        torch.manual_seed(5)
        theirs = modeling.Qwen3MoeSparseMoeBlock(config)
        for param in theirs.parameters():
            torch.nn.init.normal_(param, std=0.5)
        ours = moe.MoEFeedForward(96, 24, 6, 2, norm_topk_prob=norm)
        ours.load_state_dict(
            {
                "router.weight": theirs.gate.weight,
                "experts.w13": theirs.experts.gate_up_proj,
                "experts.w2": theirs.experts.down_proj,
            }
        )
        x = torch.randn(2, 7, 96)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def test_load_balancing_loss_equals_transformers():
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(3 * 7, 6, generator=g) for _ in range(3))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :4] = 0
    for attention_mask in (None, mask):
        expected = modeling.load_balancing_loss_func(logits, 6, 2, attention_mask)
        ours = moe.load_balancing_loss(logits, 6, 2, attention_mask)
        torch.testing.assert_close(ours, expected)


def test_model_aux_loss_equals_transformers(hf_moe):
    directory, hf_model = hf_moe
    model = lmforge.load(directory).model.train()
    tokens = _tokens(seed=6)
    model(tokens)
    theirs = hf_model(tokens, labels=tokens, output_router_logits=True)
    assert len(model.router_logits()) == len(theirs.router_logits)
    coef = hf_model.config.router_aux_loss_coef
    torch.testing.assert_close(model.aux_loss(), coef * theirs.aux_loss, atol=1e-6, rtol=1e-5)
    model.eval()


# ---- the planner ----------------------------------------------------------------------------


def test_plan_and_model_info_show_active_parameters(capsys):
    assert cli.main(
        ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-memory", "h100"]
    ) in (0, 1)
    out = capsys.readouterr().out
    assert "30.53B parameters, 3.35B active a token (48 layers" in out
    assert cli.main(["model", "info", "qwen3-235b-a22b"]) == 0
    out = capsys.readouterr().out
    assert "active:      22,190,763,520" in out
    assert "layers.0.feed_forward.experts.w13" in out


def test_dry_run_shards_equal_the_arithmetic():
    from lmforge.plan import Setup, dry_run

    args = models.get_preset("qwen3-30b-a3b").replace(
        dim=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        ffn_dim=160,
        vocab_size=250,
        num_experts=4,
        num_experts_per_tok=2,
        moe_ffn_dim=32,
        mlp_only_layers=(1,),
    )
    report = dry_run(Setup(args=args, gpus=4, tp=2))
    assert report.mismatches == []
    assert report.tensors["layers.0.feed_forward.experts.w13"].local_shape == (2, 64, 64)


def test_fuse_projections_joins_attention_and_dense_mlps_only(tmp_path):
    make_hf_qwen3_moe(tmp_path / "m", seed=7)
    model = lmforge.load(tmp_path / "m").model
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    tokens = _tokens(seed=7)
    with torch.no_grad():
        reference = model(tokens)
        assert model.fuse_projections() and model.fuse_projections()  # twice: already fused
        assert model.layers["1"].feed_forward.w13 is not None  # the dense layer
        assert all(block.attention.wqkv is not None for block in model.layers.values())
        torch.testing.assert_close(model(tokens), reference, rtol=0, atol=1e-5)
    fused_state = model.state_dict()
    assert sorted(fused_state) == sorted(state)
    assert all(torch.equal(fused_state[name], state[name]) for name in state)


# ---- quantization ------------------------------------------------------------------------------


def test_quantization_covers_the_experts_or_says_it_cannot(tmp_path, capsys):
    """compressed-tensors (W4A16, W8A16, fp8) quantizes every expert's projections under the
    hub's per-expert names and leaves the router: transformers loads each with lmforge's logits
    (W4A16 / W8A16: the same dequantized weights; fp8: lmforge also quantizes attention's
    inputs), and lmforge keeps the experts quantized (int4 two a byte, int8, float8). torchao's
    layouts do not cover stacked experts: refused, naming what does, not skipped."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    make_hf_qwen3_moe(tmp_path / "m", seed=4, hidden_size=64, moe_intermediate_size=32)
    tokens = torch.tensor([[1, 5, 9, 20, 33, 7]])
    kept = {"int4-wo": torch.uint8, "int8-wo": torch.int8, "fp8": torch.float8_e4m3fn}
    compressed = ["--format", "compressed-tensors"]
    for scheme, extra, tolerance in (("int4-wo", [*compressed, "--group-size", "8"], 1e-4),
                                     ("int8-wo", compressed, 1e-4), ("fp8", [], 0.1)):  # fmt: skip
        out = tmp_path / scheme
        assert (
            cli.main(["quantize", str(tmp_path / "m"), str(out), "--scheme", scheme, *extra]) == 0
        )
        with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
            keys = set(f.keys())
        suffix = "weight_packed" if scheme == "int4-wo" else "weight_scale"
        assert f"model.layers.0.mlp.experts.3.down_proj.{suffix}" in keys
        assert "model.layers.0.mlp.gate.weight_scale" not in keys  # the router as it was
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        ours = lmforge.load(out, dtype="float32").model
        with torch.no_grad():
            want, got = theirs(tokens).logits, ours(tokens)
        assert ((got - want).norm() / want.norm()).item() < tolerance
        experts = ours.layers["0"].feed_forward.experts
        assert type(experts) is moe.QuantizedExperts and experts.w2.dtype == kept[scheme]
        rows = (ours.args.num_experts, 2 * 32)  # [E, 2·moe_intermediate_size]
        assert experts.w13.shape[:2] == rows and experts.w13_scale.shape[:2] == rows
    assert cli.main(["quantize", str(tmp_path / "m"), str(tmp_path / "ao"), "--scheme",
                     "int8-wo"]) == 2  # fmt: skip
    assert "does not quantize its experts" in capsys.readouterr().err
    # no --group-size: the largest of 128, 64, 32 that divides the experts' width (32) too
    make_hf_qwen3_moe(tmp_path / "m32", hidden_size=64, moe_intermediate_size=32, head_dim=32)
    out = tmp_path / "default-group"
    assert cli.main(["quantize", str(tmp_path / "m32"), str(out), "--scheme", "int4-wo",
                     "--format", "compressed-tensors"]) == 0  # fmt: skip
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert next(iter(config["config_groups"].values()))["weights"]["group_size"] == 32
