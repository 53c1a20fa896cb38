"""The gpt-oss family against transformers' `GptOssForCausalLM` on odd shapes: logits (biased,
sink-carrying attention, a sliding window shorter than the prompt, the top-k-then-softmax router,
biased experts with the clamped SwiGLU, YaRN), the hub's MXFP4 experts dequantized as
transformers does, the export transformers loads back, greedy tokens through the one engine
(prompts past the window), and a training step's gradients (the auxiliary loss included); then
pretraining through the CLI and the planner's counts."""

from __future__ import annotations

import json

import pytest
import torch

import lmforge
from lmforge import models
from lmforge.generate import Generator, SamplingParams
from lmforge.models.gpt_oss import hf as gpt_oss_hf
from lmforge.models.gpt_oss.model import yarn_attention_factor, yarn_frequencies

transformers = pytest.importorskip("transformers")

# Odd on purpose: head_dim 24 (not hidden / heads), 5 experts of width 40, top-2, a window of
# 5 tokens in blocks 0 and 2, YaRN with a small original context.
SHAPE = dict(
    vocab_size=211, hidden_size=72, intermediate_size=40, num_hidden_layers=3,
    num_attention_heads=3, num_key_value_heads=1, head_dim=24, num_local_experts=5,
    num_experts_per_tok=2, sliding_window=5, max_position_embeddings=512,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                     "original_max_position_embeddings": 64, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False},
    router_aux_loss_coef=0.01, tie_word_embeddings=False,
)  # fmt: skip


def make_hf_gpt_oss(directory, seed: int = 0, **changes):
    """A random GptOssForCausalLM saved to `directory`, its biases and sinks away from zero
    and its routers scaled so that each token's top-k is far from a tie."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**(SHAPE | changes))
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0, 0.5)
            elif name.endswith("router.weight"):
                param.mul_(20.0)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def hf_gpt_oss(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt-oss")
    return directory, make_hf_gpt_oss(directory)


def _tokens(seed: int = 0, shape=(2, 13)) -> torch.Tensor:
    return torch.randint(0, 211, shape, generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(hf_gpt_oss):
    directory, hf_model = hf_gpt_oss
    loaded = lmforge.load(directory)
    assert loaded.config.family == "gpt_oss" and loaded.config.window(1) is None
    tokens = _tokens()
    with torch.no_grad():
        ours, theirs = loaded.model(tokens), hf_model(tokens).logits
        assert (ours - theirs).abs().max().item() <= 1e-5
        for block in loaded.model.layers.values():  # the grouped experts path alike
            block.feed_forward.experts.grouped = True
        assert (loaded.model(tokens) - theirs).abs().max().item() <= 1e-5


def test_yarn_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.GptOssConfig(**SHAPE)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    args = models.args_from_hf_config(config.to_dict(), "config.json")
    torch.testing.assert_close(yarn_frequencies(args), inv_freq.float())
    assert yarn_attention_factor(args) == pytest.approx(factor)


def test_mxfp4_experts_dequantize_as_transformers_does(tmp_path):
    """The hub's files: experts as MXFP4 blocks and scales beside the other tensors, a
    quantization_config transformers reads; lmforge dequantizes them at load to transformers'
    own values (`convert_moe_packed_tensors`). MXFP4 blocks are 32 wide: widths of 64 and 32."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory = tmp_path / "bf16"
    make_hf_gpt_oss(directory, hidden_size=64, intermediate_size=32, head_dim=16)
    state = lmforge.artifact.read_safetensors(directory)
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = state.pop(name).shape  # transformers: [E, in, out]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=generator)
        scales = torch.randint(120, 130, (experts, rows, cols // 32), generator=generator)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks.byte(), scales.byte()
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(state, out / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config))
    ours = lmforge.load(out, dtype="float32").model.state_dict()
    for layer in range(3):
        prefix = f"model.layers.{layer}.mlp.experts"
        theirs = {
            name: convert_moe_packed_tensors(
                state[f"{prefix}.{name}_blocks"],
                state[f"{prefix}.{name}_scales"],
                dtype=torch.float32,
            )  # [E, in, out]
            for name in ("gate_up_proj", "down_proj")
        }
        ours_hf = gpt_oss_hf.to_hf_layout(
            {f"{prefix}.gate_up_proj": ours[f"layers.{layer}.feed_forward.experts.w13"],
             f"{prefix}.down_proj": ours[f"layers.{layer}.feed_forward.experts.w2"]}
        )  # fmt: skip
        for name, want in theirs.items():
            torch.testing.assert_close(ours_hf[f"{prefix}.{name}"], want, rtol=0, atol=0)
    assert cols % 32 == 0 and rows > 0

    # Kept as MXFP4 (the inference commands' load): a quarter of the bytes, the same logits,
    # and the engine's greedy tokens through the fused kernels (Triton's interpreter).
    from lmforge.models import moe
    from lmforge.sizes import module_bytes

    dequantized = lmforge.load(out, dtype="float32")
    kept = lmforge.load(out, dtype="float32", keep_quantized=True)
    experts = kept.model.layers["0"].feed_forward.experts
    assert type(experts) is moe.QuantizedExperts and experts.w13_scale.dtype == torch.uint8
    assert module_bytes(kept.model) < 0.5 * module_bytes(dequantized.model)
    from lmforge.plan.inference import InferenceSetup, weight_bytes

    planned = weight_bytes(InferenceSetup(args=kept.config, dtype="fp32", mxfp4_experts=True))
    assert planned == pytest.approx(module_bytes(kept.model), rel=0.02)  # the planner's count
    tokens = _tokens(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(kept.model(tokens), dequantized.model(tokens), rtol=0, atol=1e-5)
    from lmforge.generate.kernels import moe as moe_kernels  # (the engine's swap on a GPU)

    assert moe_kernels.use_fused_experts(kept.model) == 3
    prompts = [_tokens(seed=n, shape=(n,)).tolist() for n in (3, 9)]
    params = SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=())
    runs = [
        Generator(m.model, max_batch=2, max_seq_len=64).generate(prompts, params)
        for m in (kept, dequantized)
    ]
    assert [r.token_ids for r in runs[0].results] == [r.token_ids for r in runs[1].results]


def test_export_loads_in_transformers_with_the_same_logits(hf_gpt_oss, tmp_path):
    directory, hf_model = hf_gpt_oss
    out = lmforge.save(lmforge.load(directory), tmp_path / "exported")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == SHAPE["layer_types"]
    original, exported = (lmforge.artifact.read_safetensors(d) for d in (directory, out))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits)


def test_greedy_tokens_equal_transformers_generate(hf_gpt_oss):
    """Prompts shorter and longer than the window, decoded past it against the engine's cache."""
    directory, hf_model = hf_gpt_oss
    hf_model.generation_config.eos_token_id = None  # exactly max_new_tokens
    loaded = lmforge.load(directory)
    prompts = [_tokens(seed=n, shape=(n,)).tolist() for n in (3, 11, 1)]
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=())
    results = Generator(loaded.model, max_batch=2, max_seq_len=64).generate(prompts, params)
    for prompt, result in zip(prompts, results.results, strict=True):
        expected = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert result.token_ids == expected


def test_a_training_steps_gradients_equal_transformers(hf_gpt_oss):
    """Mean cross entropy + router_aux_loss_coef × the load-balancing loss: the sinks', the
    router's, the experts' biases' and the embedding's gradients."""
    directory, _ = hf_gpt_oss
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory).train()
    tokens = _tokens(seed=5, shape=(2, 9))
    out = hf_model(tokens, labels=tokens, output_router_logits=True)
    out.loss.backward()
    model = lmforge.load(directory).model.train()
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    (loss + model.aux_loss()).backward()
    hf_layer, ours = hf_model.model.layers[2], model.layers["2"]
    pairs = [
        (ours.attention.sinks, hf_layer.self_attn.sinks),
        (ours.attention.wq.bias, hf_layer.self_attn.q_proj.bias),
        (ours.feed_forward.router.weight, hf_layer.mlp.router.weight),
        (ours.feed_forward.router.bias, hf_layer.mlp.router.bias),
        (ours.feed_forward.experts.b2, hf_layer.mlp.experts.down_proj_bias),
        (model.tok_embeddings.weight, hf_model.model.embed_tokens.weight),
    ]
    for param, theirs in pairs:
        torch.testing.assert_close(param.grad, theirs.grad, atol=1e-6, rtol=1e-4)


def test_pretrain_from_the_preset_then_tp_and_ep_match_one_process(tmp_path):
    """`lmforge pretrain` on gpt-oss-20b cut down (model.overrides), its loss falling and the
    experts' load logged; `lmforge model info` counts total and active parameters as the
    model has them. On two gloo processes, parallel.tp = 2 (attention split by head, the sinks
    with it, the sparse MLP replicated) and parallel.ep = 2 (the biased experts split by
    expert) give one process's losses, aux losses and gradient norms (one row a micro-batch:
    each micro-batch's aux loss is its own in every layout)."""
    from tests.train_utils import make_shards, pretrain_args, run_inprocess, run_torchrun

    tokenizer, shards = make_shards(tmp_path / "data")
    shape = dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=32,
                 num_experts=4, num_experts_per_tok=2, sliding_window=8)  # fmt: skip
    model = ["model.source=gpt-oss-20b", f"model.tokenizer={tokenizer}"]
    model += [f"model.overrides.{k}={v}" for k, v in shape.items()]
    model += ["train.micro_batch_size=1", "train.global_batch_size=2"]

    def pretrain(name: str, *extra: str) -> dict[int, dict]:
        run_dir = tmp_path / name
        dense = pretrain_args(run_dir, tokenizer, shards)
        argv = [a for a in dense if not a.startswith("model.")] + model + list(extra)
        if extra:
            run_torchrun(2, "pretrain", argv)
        else:
            assert run_inprocess("pretrain", argv) == 0
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    one = pretrain("one")
    assert one[max(one)]["loss"] < one[1]["loss"] and "expert_load_max/1" in one[1]
    loaded = lmforge.load(tmp_path / "one" / "artifact")
    actual = sum(p.numel() for p in loaded.model.parameters())
    assert loaded.config.num_params() == actual
    for layout in ("parallel.tp=2", "parallel.ep=2"):
        records = pretrain(layout.replace("parallel.", "").replace("=", ""), layout)
        assert sorted(records) == sorted(one)
        for step, record in one.items():
            for key in ("loss", "aux_loss", "grad_norm"):
                assert records[step][key] == pytest.approx(record[key], rel=1e-5, abs=1e-6), (
                    layout, step, key,
                )  # fmt: skip


def test_lora_on_the_experts_equals_peft_both_ways(hf_gpt_oss, tmp_path):
    """LoRA on gpt-oss's biased experts (and attention and the router): our adapter loads in
    PEFT onto transformers' model (target_parameters on its transposed, interleaved stacks)
    with equal logits, merged too; PEFT's own loads into ours; gradients reach every adapter,
    none the frozen biases; the planner takes the default targets."""
    from safetensors.torch import load_file

    from lmforge import cli
    from lmforge.modules import lora
    from tests.test_moe_lora import perturb_adapters

    peft = pytest.importorskip("peft")
    directory, hf_model = hf_gpt_oss
    loaded = lmforge.load(directory)
    cfg = lora.LoRASection(enabled=True, rank=3, alpha=6, targets=["q", "o", "experts", "router"])
    lora.apply_lora(loaded.model, targets=cfg.targets, rank=cfg.rank, alpha=cfg.alpha)
    perturb_adapters(loaded.model, std=0.05)
    tokens = _tokens(seed=3)
    loaded.model(tokens).square().mean().backward()
    trained = {n for n, p in loaded.model.named_parameters() if p.grad is not None}
    assert any("experts.lora_b.w13" in n for n in trained)
    assert all(".lora_" in n for n in trained)  # the experts' biases stay frozen
    adapter = lora.save_peft_adapter(
        loaded.model, loaded.config, tmp_path / "ours", base_model=str(directory), lora_cfg=cfg
    )
    stored = load_file(adapter / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.mlp.experts"
    assert stored[f"{prefix}.base_layer.lora_B.weight"].shape == (2 * 40, 3 * 5)  # gate_up
    with torch.no_grad():
        ours = loaded.model(tokens)
        assert (ours - hf_model(tokens).logits).abs().max() > 1e-3  # the adapters matter
        peft_model = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
        torch.testing.assert_close(peft_model(tokens).logits, ours, atol=2e-5, rtol=0)
        hf_model = peft_model.unload()  # the fixture's model, unadapted again
        again = lmforge.load(directory)
        lora.load_peft_adapter(again.model, adapter)
        torch.testing.assert_close(again.model(tokens), ours, atol=1e-6, rtol=0)
        lora.merge_lora(again.model)
        experts = again.model.layers["1"].feed_forward.experts
        assert type(experts).__name__ == "BiasedExperts" and not lora.lora_modules(again.model)
        torch.testing.assert_close(again.model(tokens), ours, atol=1e-5, rtol=0)

    theirs = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(directory),
        peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["k_proj"], task_type="CAUSAL_LM",
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )  # fmt: skip
    perturb_adapters(theirs, seed=4, std=0.1)
    theirs.save_pretrained(tmp_path / "theirs")
    mine = lmforge.load(directory)
    assert lora.load_peft_adapter(mine.model, tmp_path / "theirs").targets == ["k", "experts"]
    with torch.no_grad():
        torch.testing.assert_close(
            mine.model(tokens), theirs.eval()(tokens).logits, atol=2e-5, rtol=0
        )
    assert cli.main(["plan", "--model", "gpt-oss-20b", "--method", "lora", "--gpus", "1"]) == 0


def test_quantize_refuses_the_stacked_experts_rather_than_skip_them(hf_gpt_oss, tmp_path, capsys):
    """compressed-tensors would take attention alone: refused in one line, exit code 2."""
    from lmforge import cli

    directory, _ = hf_gpt_oss
    for scheme in (["--scheme", "int4-wo", "--format", "compressed-tensors"], ["--scheme", "fp8"]):
        assert cli.main(["quantize", str(directory), str(tmp_path / "q"), *scheme]) == 2
        assert "experts are stored stacked" in capsys.readouterr().err
