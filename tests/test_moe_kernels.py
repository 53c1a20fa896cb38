"""The engine's fused small-batch Mixture-of-Experts path (lmforge/generate/kernels/moe.py), run on
the CPU by Triton's interpreter: `fused_experts` against the experts' loop (models/moe.py) on
odd shapes, fp32 and bf16; which forwards `FusedExperts` sends to it; a dynamic batch
dimension compiled without a guard; greedy tokens through the engine equal to the model's own
paths; and both kernels compiled for an H100/H200 without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton")  # Linux only (pyproject's test extra)

from lmforge.api import build_model
from lmforge.generate.kernels import moe as moe_kernels
from lmforge.models import moe
from tests.test_qwen3_moe import _routed as routed
from tests.train_utils import small_qwen3_moe_args

# (E, k, dim, I): none a multiple of the interpreter's 16-row, 32-column tiles
SHAPES = [(5, 2, 48, 40), (8, 3, 80, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_experts_equal_the_loop(shape, tokens, dtype):
    num_experts, top_k, dim, ffn = shape
    x, w13, w2, weights, experts = routed(tokens, dim, ffn, num_experts, top_k, seed=tokens)
    x, w13, w2, weights = (t.to(dtype) for t in (x, w13, w2, weights))
    got = moe_kernels.fused_experts(x, w13, w2, weights, experts)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.float32:
        want = moe.experts_loop(x, w13, w2, weights, experts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    # bf16: fp32 sums and one rounding of h, against the loop's arithmetic in fp32 on the same
    # bf16 values and against the loop in bf16 (which rounds at every step).
    # (The interpreter rounds fp32 to bf16 toward zero, a GPU to nearest: looser here.)
    exact = moe.experts_loop(*(t.float() for t in (x, w13, w2, weights)), experts)
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)
    loop = moe.experts_loop(x, w13, w2, weights, experts)
    torch.testing.assert_close(got.float(), loop.float(), rtol=4e-2, atol=4e-2)


def _quantized(weight: torch.Tensor, kind: str, group: int):
    """A stack [E, rows, cols] as `QuantizedExperts` holds it: (values, scale [E, rows,
    cols / group]), symmetric, int8 / int4 (packed two a byte) / float8 e4m3."""
    from lmforge.quantize.stored import pack_int4

    grouped = weight.unflatten(-1, (-1, group))  # [E, rows, groups, group]
    top = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}[kind]
    scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-8) / top
    values = (grouped / scale).flatten(-2)
    if kind == "fp8":
        return values.to(torch.float8_e4m3fn), scale.squeeze(-1)
    values = values.round().clamp(-top - 1, top).to(torch.int8)
    return (pack_int4(values) if kind == "int4" else values), scale.squeeze(-1)


@pytest.mark.parametrize(
    "kind, group13, group2", [("int8", 48, 40), ("int4", 16, 8), ("fp8", 48, 40)]
)
@pytest.mark.parametrize("tokens", [1, 5])
def test_quantized_experts_read_in_the_kernels_equal_their_dequantized_loop(
    kind, group13, group2, tokens, monkeypatch
):
    """int8 and float8 with a scale a row, int4 two a byte with groups of columns: the kernels
    scale what they read as `moe.dequantize` does, and the engine's `FusedQuantizedExperts`
    takes them up to QUANTIZED_FUSED_PAIRS pairs (512 on a GPU, where plain experts stop at
    64; dequantizing for the grouped path past it, here past 64)."""
    monkeypatch.setattr(moe_kernels, "QUANTIZED_FUSED_PAIRS", 512)
    decode = torch.empty(64, 48), torch.empty(64, 8)  # a decode step of 64 rows, top 8
    assert moe_kernels.fused_fits(*decode[:1], torch.float32, decode[1], quantized=True)
    assert not moe_kernels.fused_fits(*decode[:1], torch.float32, decode[1])
    monkeypatch.setattr(moe_kernels, "QUANTIZED_FUSED_PAIRS", 64)
    x, w13, w2, weights, experts = routed(tokens, 48, 40, 5, 2, seed=tokens)
    q13, s13 = _quantized(w13, kind, group13)
    q2, s2 = _quantized(w2, kind, group2)
    got = moe_kernels.fused_experts(x, q13, q2, weights, experts, s13, s2)
    dequantized = moe.dequantize(q13, s13), moe.dequantize(q2, s2)
    want = moe.experts_loop(x, *dequantized, weights, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    close = moe.experts_loop(x, w13, w2, weights, experts)  # the weights before quantization
    assert ((got - close).norm() / close.norm()).item() < {"int4": 0.2}.get(kind, 0.05)
    module = moe.QuantizedExperts(q13, s13, q2, s2)
    moe_kernels.use_fused_experts(module)
    assert type(module) is moe_kernels.FusedQuantizedExperts
    with torch.no_grad():
        torch.testing.assert_close(module(x, weights, experts), want, rtol=1e-5, atol=1e-5)
        many = torch.cat([x] * 40)  # past it: dequantized, the loop or grouped path
        repeated = [torch.cat([t] * 40) for t in (weights, experts)]
        torch.testing.assert_close(
            module(many, *repeated), torch.cat([want] * 40), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("tokens", [1, 5])
def test_biased_experts_with_the_clamped_swiglu_equal_the_loop(tokens):
    """gpt-oss's experts: each projection's bias and (up + 1)·gate·σ(1.702·gate), clamped at
    7, in the kernels as in the loop (inputs scaled up so that the clamps bite)."""
    x, w13, w2, weights, experts = routed(tokens, 48, 40, 5, 2, seed=tokens)
    generator = torch.Generator().manual_seed(tokens)
    x = x * 8
    biases = moe.ExpertBiases(
        torch.randn(5, 80, generator=generator), torch.randn(5, 48, generator=generator),
        moe.ClampedSwiGLU(alpha=1.702, limit=7.0),
    )  # fmt: skip
    got = moe_kernels.fused_experts(x, w13, w2, weights, experts, biases=biases)
    want = moe.experts_loop(x, w13, w2, weights, experts, biases=biases)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    module = moe.BiasedExperts(48, 40, 5, biases.activation)
    with torch.no_grad():
        for name, value in (("w13", w13), ("w2", w2), ("b13", biases.b13), ("b2", biases.b2)):
            getattr(module, name).copy_(value)
    assert moe_kernels.use_fused_experts(module) == 1
    assert type(module) is moe_kernels.FusedBiasedExperts
    with torch.no_grad():
        torch.testing.assert_close(module(x, weights, experts), want, rtol=1e-5, atol=1e-4)


def _mxfp4(shape, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random MXFP4 stack [E, rows, cols] as gpt-oss's hub files hold it (and
    `QuantizedExperts` keeps it): e2m1 values two a byte [E, rows, cols / 2], a scale byte
    (2^(byte - 127)) a group of 32 columns."""
    from lmforge.quantize.stored import pack_int4

    nibbles = torch.randint(0, 16, shape, generator=generator)
    values = pack_int4((nibbles.to(torch.int8) ^ 8) - 8)  # the nibbles' bits, two a byte
    scales = torch.randint(122, 131, (*shape[:-1], shape[-1] // 32), generator=generator)
    return values, scales.to(torch.uint8)


@pytest.mark.parametrize("tokens", [1, 5])
def test_mxfp4_biased_experts_read_in_the_kernels_equal_their_dequantized_loop(tokens, monkeypatch):
    """gpt-oss's experts kept as its hub's MXFP4 (e2m1 values, a power-of-two scale a group of
    32; the down projection's 32 columns one group: the row-scale path) with their biases: the
    kernels decode what `moe.dequantize` decodes, and `QuantizedExperts` over them takes the
    fused path for a few tokens and the dequantized one past QUANTIZED_FUSED_PAIRS (lowered)."""
    monkeypatch.setattr(moe_kernels, "QUANTIZED_FUSED_PAIRS", 64)
    x, _, _, weights, experts = routed(tokens, 64, 32, 5, 2, seed=tokens)
    generator = torch.Generator().manual_seed(tokens)
    (q13, s13), (q2, s2) = _mxfp4((5, 64, 64), generator), _mxfp4((5, 64, 32), generator)
    dequantized = moe.dequantize(q13, s13, x.dtype), moe.dequantize(q2, s2, x.dtype)
    biases = moe.ExpertBiases(
        torch.randn(5, 64, generator=generator), torch.randn(5, 64, generator=generator),
        moe.ClampedSwiGLU(alpha=1.702, limit=7.0),
    )  # fmt: skip
    got = moe_kernels.fused_experts(x, q13, q2, weights, experts, s13, s2, biases)
    want = moe.experts_loop(x, *dequantized, weights, experts, biases=biases)
    # (fp32 sums of terms up to 2^3 · 6 · |x|, in another order: outputs near 50 differ by ~1e-3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    module = moe.QuantizedExperts(q13, s13, q2, s2, biases=biases)
    assert moe_kernels.use_fused_experts(module) == 1
    with torch.no_grad():
        torch.testing.assert_close(module(x, weights, experts), want, rtol=1e-4, atol=1e-3)
        many = torch.cat([x] * 40)  # past it
        repeated = [torch.cat([t] * 40) for t in (weights, experts)]
        torch.testing.assert_close(
            module(many, *repeated), torch.cat([want] * 40), rtol=1e-4, atol=1e-3
        )


def test_repeated_experts_and_a_token_on_one_expert():
    """Every token choosing the same experts (each read once a pair), and tokens whose weights
    put everything, or nearly everything, on one of them."""
    x, w13, w2, _, _ = routed(4, 48, 40, 5, 2, seed=7)
    experts = torch.tensor([[3, 1]] * 4)
    weights = torch.tensor([[0.6, 0.4], [1.0, 0.0], [0.999, 0.001], [0.0, 1.0]])
    got = moe_kernels.fused_experts(x, w13, w2, weights, experts)
    torch.testing.assert_close(got, moe.experts_loop(x, w13, w2, weights, experts))
    alone = torch.nn.functional.linear(
        moe._swiglu(torch.nn.functional.linear(x[1], w13[3])), w2[3]
    )  # token 1: expert 3's output, whole
    torch.testing.assert_close(got[1], alone, rtol=1e-5, atol=1e-5)


def _moe_layer(top_k: int = 2) -> moe.MoEFeedForward:
    layer = moe.MoEFeedForward(48, 40, 5, top_k, norm_topk_prob=True)
    layer.init_weights(0.2, 0.2)
    return layer


def _greedy_tokens(model, prompts) -> list[list[int]]:
    """5 greedy tokens of each prompt through the engine (2 rows, 64 slots)."""
    from lmforge.generate import Generator, SamplingParams

    params = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=())
    results = Generator(model, max_batch=2, max_seq_len=64).generate(prompts, params).results
    return [r.token_ids for r in results]


def _counted(monkeypatch) -> list[int]:
    """The token counts `fused_experts` is called with, from here on."""
    calls = []
    fused = moe_kernels.fused_experts

    def counted(x, *args):
        calls.append(x.shape[0])
        return fused(x, *args)

    monkeypatch.setattr(moe_kernels, "fused_experts", counted)
    return calls


def test_the_swapped_experts_take_the_fused_path_for_a_few_tokens_without_autograd(monkeypatch):
    layer = _moe_layer()
    reference = copy.deepcopy(layer)
    names = sorted(layer.state_dict())
    assert moe_kernels.use_fused_experts(layer) == 1
    assert isinstance(layer.experts, moe.Experts) and sorted(layer.state_dict()) == names
    assert moe_kernels.use_fused_experts(layer) == 0  # once
    calls = _counted(monkeypatch)
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(layer(x[:1, :3]), reference(x[:1, :3]))  # 6 pairs
        torch.testing.assert_close(layer(x), reference(x))  # 30 pairs
    assert calls == [3, 15]
    monkeypatch.setattr(moe_kernels, "FUSED_PAIRS", 29)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(x))  # 30 pairs: the model's own path
    assert calls == [3, 15]
    out = layer(x[:1, :3])  # with autograd: the model's own path, and its gradients
    out.sum().backward()
    assert calls == [3, 15] and layer.experts.w13.grad is not None


def test_lora_experts_and_hooked_experts_stay():
    from lmforge.modules import lora

    model = build_model(small_qwen3_moe_args(), dtype=torch.float32, seed=0)
    lora.apply_lora(model, targets=["experts"], rank=2, alpha=4)
    assert moe_kernels.use_fused_experts(model) == 0
    model = build_model(small_qwen3_moe_args(), dtype=torch.float32, seed=0)
    model.layers["0"].feed_forward.experts.register_forward_hook(lambda m, i, o: o)
    assert moe_kernels.use_fused_experts(model) == model.args.num_layers - 1


def test_a_dynamic_batch_compiles_without_a_guard_on_the_token_count(monkeypatch):
    """The engine compiles one step for every batch bucket above 1 (a dynamic batch dimension
    with a range): the fused-or-not choice is made inside the opaque op, at run time, so the
    trace holds no guard on the token count that the range would refuse."""
    layer = _moe_layer()
    reference = copy.deepcopy(layer)
    moe_kernels.use_fused_experts(layer)
    calls = _counted(monkeypatch)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for tokens in (2, 40):  # 4 pairs (fused), 80 (the loop)
        x = torch.randn(tokens, 1, 48, generator=g)
        torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), reference(x))
    assert calls == [2]


def test_the_engine_decodes_the_same_greedy_tokens_on_the_fused_path(monkeypatch):
    """A tiny Qwen3-MoE through the engine (its CUDA swap made here by hand, as on the
    interpreter the engine makes none): the same greedy tokens as the model's own paths. The
    first two prompts' prefill (80 padded tokens, 160 pairs, above `FUSED_PAIRS`) takes the
    loop; their decode steps (2 rows), the third prompt's prefill (3 tokens, alone once a row
    is free) and its decode steps (1 row) take the fused kernels."""

    model = build_model(small_qwen3_moe_args(), dtype=torch.float32, seed=0)
    with torch.no_grad():  # routers far from ties between their k-th and (k+1)-th choice
        for block in model.layers.values():
            block.feed_forward.router.weight.mul_(20.0)
    reference = copy.deepcopy(model)
    assert moe_kernels.use_fused_experts(model) == model.args.num_layers
    calls = _counted(monkeypatch)
    prompts = [[5, 17, 33, 2, 9], list(range(3, 43)), [7, 8, 9]]
    outputs = [_greedy_tokens(m, prompts) for m in (reference, model)]
    assert outputs[0] == outputs[1]
    assert set(calls) == {1, 2, 3}  # (each times the model's sparse blocks)


def test_the_engine_decodes_gpt_oss_on_the_fused_path(monkeypatch):
    """gpt-oss's biased experts in the fused kernels through the engine: the model's own
    greedy tokens."""
    from lmforge.models import get_preset

    args = get_preset("gpt-oss-20b").replace(
        dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=32,
        num_experts=4, num_experts_per_tok=2, vocab_size=256, sliding_window=4, bos_id=None,
        eos_id=None, max_seq_len=256,
    )  # fmt: skip
    model = build_model(args, dtype=torch.float32, seed=0)
    with torch.no_grad():  # routers far from ties, biases away from zero
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * 0.3)
            if name.endswith("router.weight"):
                param.mul_(20.0)
    reference = copy.deepcopy(model)
    assert moe_kernels.use_fused_experts(model) == 2
    calls = _counted(monkeypatch)
    outputs = [_greedy_tokens(m, [[5, 17, 33, 2, 9], [7, 8, 9]]) for m in (reference, model)]
    assert outputs[0] == outputs[1] and calls


@pytest.mark.parametrize("scheme", ["int4-wo", "int8-wo"])
def test_the_engine_decodes_a_quantized_moe_on_its_integers(tmp_path, monkeypatch, scheme):
    """A compressed-tensors artifact (`lmforge quantize --format compressed-tensors`): its
    experts stay quantized in the model and the engine's fused kernels read them at decode,
    giving the greedy tokens of the model's own (dequantizing) path."""
    import lmforge
    from lmforge import cli
    from tests.test_qwen3_moe import make_hf_qwen3_moe

    make_hf_qwen3_moe(tmp_path / "m", seed=4, hidden_size=64, moe_intermediate_size=32)
    out = tmp_path / scheme
    quantize = ["quantize", str(tmp_path / "m"), str(out), "--scheme", scheme]
    assert cli.main([*quantize, "--format", "compressed-tensors", "--group-size", "8"]) == 0
    model = lmforge.load(out, dtype="float32").model
    reference = copy.deepcopy(model)
    assert moe_kernels.use_fused_experts(model) == 2  # the sparse layers (one is dense)
    calls = _counted(monkeypatch)
    outputs = [_greedy_tokens(m, [[5, 17, 33, 2, 9], [7, 8, 9]]) for m in (reference, model)]
    assert outputs[0] == outputs[1]
    assert calls


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmforge.generate.kernels import moe

target = GPUTarget("cuda", 90, 32)
compiled = 0
# (activations, weights, 4 bits two a byte, columns a scale covers: 0 none, -1 a row, biases,
# MXFP4)
KINDS = (("bf16", "bf16", False, 0, False, False), ("fp32", "fp32", False, 0, False, False),
         ("bf16", "i8", False, -1, False, False), ("bf16", "u8", True, 128, False, False),
         ("bf16", "fp8e4nv", False, -1, False, False),
         ("bf16", "bf16", False, 0, True, False), ("bf16", "u8", True, 32, True, True))  # gpt-oss
for dtype, weights, packed, group, biased, fp4 in KINDS:
    for kernel, (block_n, block_k, warps), cols in ((moe._gate_up, moe.GATE_UP_TILE, 2048),
                                                    (moe._down, moe.DOWN_TILE, 768)):
        signature = {name: "*" + dtype for name in kernel.arg_names if name.endswith("_ptr")}
        signature |= {"experts_ptr": "*i64", "weights_ptr": "*" + dtype}
        signature |= {name: "*" + weights for name in ("w13_ptr", "w2_ptr")}
        signature |= {"scale_ptr": "*u8"} if fp4 else {}
        # Qwen3-30B-A3B's shapes
        constants = {"DIM": 2048, "FFN": 768, "TOP_K": 8, "BLOCK_N": block_n, "BLOCK_K": block_k,
                     "PACKED": packed, "GROUP": cols if group == -1 else group,
                     "HAS_BIAS": biased, "FP4": fp4}
        if kernel is moe._gate_up:
            constants |= {"LIMIT": 7.0 if biased else 0.0, "ALPHA": 1.702 if biased else 0.0}
        signature |= {name: "constexpr" for name in constants}
        signature = {name: signature[name] for name in kernel.arg_names}
        source = ASTSource(kernel, signature, constexprs=constants)
        ptx = triton.compile(source, target=target, options={"num_warps": warps}).asm["ptx"]
        assert "atom." not in ptx  # one store an output, no atomics
        compiled += 1
for dtype in ("bf16", "fp32"):
    signature = {"logits_ptr": "*" + dtype, "weights_ptr": "*" + dtype, "experts_ptr": "*i64",
                 "bias_ptr": "*fp32"}
    constants = {"E": 128, "BLOCK_E": 128, "TOP_K": 8, "BLOCK_TOP_K": 8, "NORM": True,
                 "HAS_BIAS": True}
    signature |= {name: "constexpr" for name in constants}
    source = ASTSource(moe._route, signature, constexprs=constants)
    triton.compile(source, target=target, options={"num_warps": 1})
    compiled += 1
print("compiled", compiled)
"""


def test_the_kernels_compile_for_a_gpu():
    """The interpreter runs code the GPU compiler refuses, so the three kernels are also compiled,
    without a GPU, for sm_90 with the ptxas Triton ships, in a process without
    TRITON_INTERPRET (as tests/test_kernels.py does for the GEMVs)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 16" in done.stdout


@pytest.mark.parametrize("norm", [True, False], ids=["normalized", "softmax"])
@pytest.mark.parametrize("num_experts,top_k,tokens", [(12, 3, 3), (128, 8, 8), (6, 2, 1)])
@pytest.mark.parametrize("biased", [False, True], ids=["", "bias"])
def test_the_routing_kernel_chooses_as_the_model_does(norm, num_experts, top_k, tokens, biased):
    """`route`'s kernel (E and k not powers of two too) picks the experts torch's top-k picks
    (with DeepSeek-V3's selection bias: of the probabilities plus the bias), largest first,
    with the model's weights; past FUSED_PAIRS pairs it is the model's own route."""
    generator = torch.Generator().manual_seed(top_k)
    logits = torch.randn(tokens, num_experts, generator=generator).bfloat16()
    bias = 0.3 * torch.randn(num_experts, generator=generator) if biased else None
    weights, experts = moe_kernels.route(logits, top_k, norm, bias)
    want_weights, want_experts = moe.route(logits, top_k, norm_topk_prob=norm, expert_bias=bias)
    if not biased:
        assert (weights.diff(dim=-1) <= 0).all()  # largest first
    ours, theirs = experts.argsort(dim=-1), want_experts.argsort(dim=-1)  # by expert
    assert torch.equal(experts.gather(1, ours), want_experts.gather(1, theirs))
    torch.testing.assert_close(weights.gather(1, ours), want_weights.gather(1, theirs))
    assert weights.dtype == torch.bfloat16 and experts.dtype == torch.int64
    many = torch.randn(moe_kernels.FUSED_PAIRS // top_k + 1, num_experts)
    got = moe_kernels.route(many, top_k, norm, bias)
    want = moe.route(many, top_k, norm_topk_prob=norm, expert_bias=bias)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_swapped_sparse_mlp_routes_in_the_kernel_without_autograd(monkeypatch):
    """`use_fused_experts` makes each sparse MLP a `FusedRouting`: without autograd its routing
    is the kernel's, with autograd the model's, and the block's output is the same."""
    model = build_model(small_qwen3_moe_args(), dtype=torch.float32, seed=0).eval()
    reference = copy.deepcopy(model)
    moe_kernels.use_fused_experts(model)
    sparse = [m for m in model.modules() if isinstance(m, moe.MoEFeedForward)]
    assert sparse and all(type(m) is moe_kernels.FusedRouting for m in sparse)
    calls = []
    kernel = moe_kernels.route
    monkeypatch.setattr(moe_kernels, "route", lambda *a: calls.append(a) or kernel(*a))
    tokens = torch.tensor([[3, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-4, atol=1e-4)
    assert len(calls) == len(sparse)
    model(tokens).sum().backward()
    assert len(calls) == len(sparse)  # with autograd: the model's route
