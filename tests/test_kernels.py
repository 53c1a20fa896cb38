"""The decode engine's quantized Triton kernels (lmforge/generate/kernels/), run on the CPU by
Triton's interpreter: against the dequantized weight, and against torchao's own linears."""

import json

import pytest
import torch

pytest.importorskip("torchao")
pytest.importorskip("triton")  # Linux only (pyproject's test extra)
import triton

from lmforge.api import build_model
from lmforge.generate import kernels
from lmforge.generate.kernels import (
    GemvLinear,
    QuantizedLinear,
    fused_block,
    gemv_kernel,
    int4,
    int8,
    shared,
    tiles,
    use_gemv,
    use_quantized_kernels,
)
from lmforge.models import get_preset

# The kernels run on the CPU under Triton's interpreter (the suite); with TRITON_INTERPRET=0 on
# a GPU, the tests that take DEVICE run the compiled kernels.
DEVICE = "cpu" if kernels.INTERPRETED else "cuda"
SMALL = get_preset("tiny").replace(
    dim=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=256, vocab_size=256
)


def dequantized(bits, q, scale, zero):
    """The weight [N, K] in fp32 from the module docstring's formulas (q unpacked)."""
    group = q.shape[1] // scale.shape[1]
    s = scale.float().repeat_interleave(group, dim=1)
    if bits == 8:
        return q.float() * s
    return (q.float() - 8) * s + zero.float().repeat_interleave(group, dim=1)


def random_layout(bits, n, k, group):
    g = torch.Generator().manual_seed(n * k + group + bits)
    if bits == 8:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(n, k // group, generator=g) * 0.01 + 1e-3
        return q, scale, scale.new_empty(n, 0)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).bfloat16()
    zero = (torch.randn(n, k // group, generator=g) * 0.01).bfloat16()
    return q, scale, zero


@pytest.mark.parametrize(
    "bits,group",
    [(8, 256), (8, 32), (4, 128), (4, 32)],  # per row; tiles spanning groups; one group a tile
    ids=["int8-row", "int8-group32", "int4-group128", "int4-group32"],
)
@pytest.mark.parametrize(
    "rows,x_tile", [(1, True), (1, False), (3, False)], ids=["gemv", "gemv-x-vector", "matmul"]
)
def test_kernels_equal_the_dequantized_product(bits, group, rows, x_tile, monkeypatch):
    """(On a GPU with TRITON_INTERPRET=0: compiled, with the autotuner's tiles.)"""
    monkeypatch.setattr(tiles, "INTERPRETED_X_TILE", x_tile)
    n, k = 24, 256  # 24: the last block of outputs is partly masked
    q, scale, zero = random_layout(bits, n, k, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = (q[:, : k // 2] | (q[:, k // 2 :] << 4)) if bits == 4 else q
    layer = QuantizedLinear(packed, scale, zero, bits).to(DEVICE)
    expected = x.float() @ dequantized(bits, q, scale, zero).t()
    got = layer(x.to(DEVICE)).cpu()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # bf16 output (and, in the tensor-core path, bf16 weight tiles): ~3 significant digits
    torch.testing.assert_close(
        got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item()
    )
    if bits == 8:  # int8 bytes, or uint8 q + 128 as `from_linear` keeps them: the same product
        offset = QuantizedLinear(q.view(torch.uint8) ^ 0x80, scale, zero, bits).to(DEVICE)
        assert torch.equal(offset(x.to(DEVICE)).cpu(), got)


@pytest.mark.parametrize(
    "bits,group,n,k",
    [(8, 256, 70, 256), (8, 48, 9, 96), (8, 4096, 3, 4096), (4, 128, 70, 512), (4, 16, 5, 64)],
    ids=["int8-row", "int8-group48", "int8-wide", "int4-group128", "int4-group16"],
)
def test_the_expansion_for_many_rows_equals_the_dequantized_weight(bits, group, n, k):
    """Past `quantized_gemm.MAX_ROWS` (prefill, scoring) a weight is expanded to x's dtype
    (`kernels.dequantize`, tiles of one group) for one matmul: the weight `dequantized` makes,
    rounded once to bf16, for rows of blocks cut short (70, 9, 3) and groups of any size."""
    q, scale, zero = random_layout(bits, n, k, group)
    packed = (q[:, : k // 2] | (q[:, k // 2 :] << 4)) if bits == 4 else q
    want = dequantized(bits, q, scale, zero)
    for stored in (packed, packed.view(torch.uint8) ^ 0x80) if bits == 8 else (packed,):
        on = [t.to(DEVICE) for t in (stored, scale, zero)]
        got = kernels.dequantize(*on, bits, torch.bfloat16).cpu()
        # (within a bf16 rounding: the interpreter rounds toward zero, a GPU to nearest)
        torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=2**-7, atol=1e-6)


INT8_HOWS = ("", " signed", " x as a vector", " exact", " exact signed", " folded")


@pytest.mark.parametrize(
    "bits",
    [16, *(f"8{how}" for how in INT8_HOWS), 4, "4 bytes from bits", "4 bytes converter"],
)
@pytest.mark.parametrize("fusion", ["norm", "norm+swiglu", "gated+residual", "residual", "split"])
def test_gemv_fusions_equal_their_arithmetic(bits, fusion, monkeypatch):
    """One row through `gemv` with the RMSNorm, SiLU·up or residual add inside equals the same
    arithmetic done apart in float32. (On a GPU with TRITON_INTERPRET=0: compiled, launched
    early, with the autotuner's tiles, at the 1B's width.) int8 is biased (`int8.INT8_BIASED`)
    with x as a tile or a vector, or "exact", or "folded" (`gemv_kernel._fold`), its bytes q + 128
    as `QuantizedLinear` keeps them or int8 ("signed"); int4 in packed
    fp16 (`int4.INT4_HALVES`) or through `_gemv` ("bytes"), its nibbles made floats from their
    bit patterns
    (`gemv_kernel.INT4_FROM_BITS`) or by the "converter". `swiglu`: silu(gate) * up of the output's
    halves, gate and up rows side by side in each program; `split`: each row's columns shared
    among two programs (split-K), then a residual add, twice (the split's counts start at 0
    again)."""
    monkeypatch.setattr(int4, "INT4_HALVES", "bytes" not in str(bits))
    monkeypatch.setattr(gemv_kernel, "INT4_FROM_BITS", "converter" not in str(bits))
    monkeypatch.setattr(int8, "INT8_BIASED", "exact" not in str(bits))
    signed = "signed" in str(bits)
    if not kernels.INTERPRETED:  # each case tunes afresh (the same shape: else the first's pick)
        monkeypatch.setattr(gemv_kernel._gemv_tuned, "cache", {})
        monkeypatch.setattr(int4._gemv_int4_tuned, "cache", {})
    if bits == "8 x as a vector":
        monkeypatch.setattr(tiles, "INTERPRETED_X_TILE", False)
    if bits == "8 folded":  # (on a GPU: among the candidates anyway)
        monkeypatch.setattr(tiles, "INTERPRETED_FOLD", True)
    if fusion == "split":
        monkeypatch.setattr(tiles, "INTERPRETED_SPLITS", 2)
        for tuner in (gemv_kernel._gemv_tuned, int4._gemv_int4_tuned):
            if not kernels.INTERPRETED:  # (only split tiles to choose from)
                split = [c for c in tuner.configs if c.kwargs["SPLITS"] == 2]
                monkeypatch.setattr(tuner, "configs", split)
    bits = int(str(bits).split()[0])
    n, k = (24, 512 if fusion == "split" else 256) if kernels.INTERPRETED else (200, 2048)
    g = torch.Generator().manual_seed(bits)
    if bits == 16:
        weight, scale, zero = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), None, None
        dense = weight.float()
    else:
        q, scale, zero = random_layout(bits, n, k, 128 if bits == 4 else k)
        weight = (q[:, : k // 2] | (q[:, k // 2 :] << 4)) if bits == 4 else q
        weight = weight if bits == 4 or signed else q.view(torch.uint8) ^ 0x80
        dense = dequantized(bits, q, scale, zero)
    gated = "gated" in fusion
    x = torch.randn(1, 2 * k if gated else k, generator=g).bfloat16()
    norm = (1 + 0.1 * torch.randn(k, generator=g)).bfloat16() if fusion == "norm" else None
    with_residual = "residual" in fusion or fusion == "split"
    residual = torch.randn(n, generator=g).bfloat16() if with_residual else None
    inputs = x.float()
    if norm is not None:
        inputs = inputs * torch.rsqrt(inputs.pow(2).mean() + 1e-5) * norm.float()
    if gated:
        gate, up = inputs.split(k, dim=-1)
        inputs = torch.nn.functional.silu(gate) * up
    want = inputs @ dense.t() + (residual.float() if residual is not None else 0)
    swiglu = "swiglu" in fusion
    if swiglu:
        gate, up = want.split(n // 2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
    on = [t.to(DEVICE) if t is not None else None for t in (x, weight, scale, zero, norm, residual)]
    x, weight, scale, zero, norm, residual = on
    if fusion == "split":  # the workspace's sums start unwritten: both halves must fill them
        partial, counts = shared._workspace(x.device, n, max(tiles.SPLIT_COUNTS))
        partial.fill_(float("nan"))
    for _ in range(2 if fusion == "split" else 1):
        got = kernels.gemv(x, weight, scale, zero, bits, norm, 1e-5, gated, residual, swiglu)
    if fusion == "split":
        assert not partial[:2].isnan().any() and partial[2:].isnan().all()
        assert not counts.any()
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("gated", ["plain", "gated", "made"])
def test_int4_halves_keep_large_activations(gated):
    """The packed fp16 products (`int4._gemv_int4`) take x scaled by 2^-shift: activations in
    the thousands (Llama's largest, SiLU·up of the down projection), or tens of thousands as
    SiLU·up (taken by the kernel from gate and up, or "made" before it), stay finite and as
    exact as small ones, and so do tiny ones beside them."""
    n, k = 24, 512
    q, scale, zero = random_layout(4, n, k, 128)
    weight = (q[:, : k // 2] | (q[:, k // 2 :] << 4)).contiguous()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, k, generator=g) * 1e-2
    x[0, :8] = torch.tensor([1500.0, -1800, 1e-3, 2000, -1e-4, 900, 1700, -2000])
    if gated != "plain":  # silu(gate) * up up to 4e4 where both are large
        x = torch.cat([x.abs() / 10, x / 10], dim=1)
        gate, up = x.split(k, dim=1)
        inputs = torch.nn.functional.silu(gate.bfloat16().float()).bfloat16().float()
        inputs = (inputs * up.bfloat16().float()).bfloat16().float()
        x = inputs if gated == "made" else x
    else:
        inputs = x.bfloat16().float()
    want = inputs @ dequantized(4, q, scale, zero).t()
    on = [t.to(DEVICE) for t in (x.bfloat16(), weight, scale, zero)]
    got = kernels.gemv(*on, 4, gated=gated != "plain").cpu().float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("k", [2048, 3072, 8192, 768])
def test_int4_tiles_fit_the_launch(k, monkeypatch, tmp_path):
    """The int4 autotuner's pruning gets the launch's arguments as Triton passes them (positional
    ones by name, the rest as keywords) and keeps only tiles whose groups divide a row's."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((args, kwargs))

    monkeypatch.setattr(int4, "_gemv_int4_tuned", Recorder())
    monkeypatch.setattr(int4, "INTERPRETED", False)  # (the launch's autotuned arguments)
    q, scale, zero = random_layout(4, 8, k, 128)
    weight = (q[:, : k // 2] | (q[:, k // 2 :] << 4)).contiguous()
    kernels.gemv(torch.zeros(1, k).bfloat16(), weight, scale, zero, 4)
    ((args, kwargs),) = launches
    named = dict(zip(int4._gemv_int4.arg_names, args))
    fits = tiles._int4_fits(tiles._int4_configs(), named, **kwargs)
    assert fits and all((k // 2 // 128) % c.kwargs["GROUPS"] == 0 for c in fits)
    assert {c.kwargs["GROUPS"] for c in fits} >= {1}
    # a tile pinned for the product (`tiles.TILES`' table) is the only one tried
    key = tiles.tile_key(named | kwargs)
    assert key == f"8 {k} 4h 128"
    table = tmp_path / "tiles.json"
    table.write_text(json.dumps({"cpu": {key: tiles.describe(fits[-1])}}))
    monkeypatch.setenv("LMFORGE_GEMV_TILES", str(table))
    tiles.pinned_tiles.cache_clear()
    try:
        pinned = tiles._int4_fits(tiles._int4_configs(), named, **kwargs)
    finally:
        tiles.pinned_tiles.cache_clear()
    assert [tiles.describe(c) for c in pinned] == [tiles.describe(fits[-1])]


def quantized_model(config):
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 40, bias=False), torch.nn.Linear(256, 24, bias=False)
    )
    model = model.bfloat16()
    quantize_(model, config)
    return model


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_torchao_linears_convert_and_agree(scheme):
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup

    config = (
        Int8WeightOnlyConfig(set_inductor_config=False)
        if scheme == "int8"
        else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(64))
    )
    model = quantized_model(config)
    x = torch.randn(2, 1, 256).bfloat16()
    with torch.no_grad():
        expected = [layer(x).float() for layer in model]
    assert use_quantized_kernels(model) == 2
    assert all(type(layer) is QuantizedLinear for layer in model)
    model, x = model.to(DEVICE), x.to(DEVICE)  # converted on the CPU, run where the kernels do
    for layer, want in zip(model, expected, strict=True):
        for inputs in (x[:1], x):  # one row (gemv) and two (matmul)
            got = layer(inputs).float().cpu()
            torch.testing.assert_close(
                got, want[: len(inputs)], rtol=2e-2, atol=2e-2 * want.abs().max().item()
            )
    joined = QuantizedLinear.concatenate(list(model))
    assert torch.equal(joined(x[:1]), torch.cat([layer(x[:1]) for layer in model], dim=-1))


def test_other_weights_stay():
    plain = torch.nn.Linear(64, 8, bias=False)
    biased = torch.nn.Linear(64, 8)
    assert QuantizedLinear.from_linear(plain) is None
    assert QuantizedLinear.from_linear(biased) is None
    narrow = torch.nn.Sequential(torch.nn.Linear(8, 64, bias=False)).bfloat16()  # LoRA's B
    assert use_gemv(narrow) == 0 and type(narrow[0]) is torch.nn.Linear
    with pytest.raises(ValueError, match="one layout"):
        a = QuantizedLinear(
            torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1), torch.ones(4, 0), 8
        )
        b = QuantizedLinear(
            torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), torch.ones(4, 2), 4
        )
        QuantizedLinear.concatenate([a, b])


@pytest.mark.parametrize("scheme", ["int8-wo", "int4-wo"])
def test_the_engine_on_the_kernels_generates_what_torchao_does(scheme):
    """The engine's CUDA path, here on the interpreter: a quantized model's linears swapped for
    the kernels, then fused (q/k/v, gate/up), gives torchao's logits and greedy tokens."""
    import copy

    from lmforge.generate import Generator, SamplingParams
    from lmforge.quantize.quantize import QuantSpec, quantize_model

    args = SMALL
    model = build_model(args, dtype=torch.float32, seed=0)
    quantize_model(model, QuantSpec(scheme, group_size=32 if scheme == "int4-wo" else None))
    reference = copy.deepcopy(model)
    assert use_quantized_kernels(model) == 7 * args.num_layers
    assert model.fuse_projections()
    block = model.layers["0"]
    assert type(block.attention.wqkv) is QuantizedLinear
    assert type(block.feed_forward.w13) is QuantizedLinear
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(tokens), model(tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())
    prompts = [tokens[0].tolist(), tokens[1, :5].tolist()]
    outputs = [
        [r.token_ids for r in Generator(m, max_batch=2).generate(prompts, params).results]
        for m in (reference, model)
    ]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_equals_f_linear(dtype):
    weight = torch.nn.Parameter((torch.randn(40, 256) * 0.05).to(dtype))
    layer = GemvLinear(weight)
    x = torch.randn(1, 1, 256).to(dtype)
    want = torch.nn.functional.linear(x.float(), weight.float())
    got = layer(x)
    assert got.shape == (1, 1, 40) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    batch = torch.randn(3, 256).to(dtype)  # more rows: F.linear itself
    assert torch.equal(layer(batch), torch.nn.functional.linear(batch, weight))


def test_gemv_swap_keeps_parameters_names_and_the_tie():
    args = SMALL.replace(num_layers=1, tie_embeddings=True)
    model = build_model(args, dtype=torch.bfloat16, seed=0)
    names = sorted(model.state_dict())
    tokens = torch.tensor([[3]])
    with torch.no_grad():
        want = model(tokens).float()
    assert model.fuse_projections()
    assert use_gemv(model) == 5  # wqkv, wo, w13, w2, output
    assert type(model.output) is GemvLinear
    assert model.output.weight is model.tok_embeddings.weight
    assert sorted(model.state_dict()) == names
    with torch.no_grad():
        got = model(tokens).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "scheme,dtype",
    [
        ("bf16", torch.bfloat16),
        ("fp32", torch.float32),
        ("int8-wo", torch.float32),
        ("int4-wo", torch.float32),
        ("fp8", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("x_tile", [True, False], ids=["x-tile", "x-vector"])
def test_fused_blocks_decode_as_the_blocks_do(scheme, dtype, x_tile, monkeypatch):
    """`FusedDecodeBlock` (norms, SiLU·up and residual adds inside the GEMVs) gives the unfused
    blocks' logits for one row, leaves several rows to the block's own forward, and (fp32)
    decodes the same greedy tokens through a KV cache."""
    import copy

    from lmforge.generate import Generator, SamplingParams
    from lmforge.quantize.quantize import QuantSpec, quantize_model
    from lmforge.quantize.stored import float8_weight

    monkeypatch.setattr(tiles, "INTERPRETED_X_TILE", x_tile)
    model = build_model(SMALL.replace(tie_embeddings=True), dtype=dtype, seed=0)
    if scheme.endswith("-wo"):
        quantize_model(model, QuantSpec(scheme, group_size=32 if scheme == "int4-wo" else None))
    if scheme == "fp8":  # as `lmforge.load` reads `--scheme fp8` (torchao quantizes none on CPUs)
        for linear in (m for m in model.layers.modules() if type(m) is torch.nn.Linear):
            linear.weight = torch.nn.Parameter(float8_weight(linear.weight.data), False)
    if scheme in ("int8-wo", "int4-wo", "fp8"):
        use_quantized_kernels(model)
    assert model.fuse_projections()
    use_gemv(model)
    reference = copy.deepcopy(model)
    names = sorted(model.state_dict())
    assert kernels.use_fused_blocks(model) == SMALL.num_layers
    assert isinstance(model.layers["0"], kernels.FusedDecodeBlock)
    assert sorted(model.state_dict()) == names
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    streams = []  # each block's output: the residual stream stays in the model's dtype
    for block in model.layers.values():
        block.register_forward_hook(lambda module, args, out: streams.append(out.dtype))
    for tokens in (torch.tensor([[7]]), torch.tensor([[7, 9, 11]])):
        with torch.no_grad():
            want, got = reference(tokens).float(), model(tokens).float()
        torch.testing.assert_close(got, want, **tolerance)
    assert streams == [dtype] * 2 * SMALL.num_layers
    if scheme == "fp32" and x_tile:  # through the KV cache (the others: the logits above)
        params = SamplingParams(max_new_tokens=3, temperature=0, stop_token_ids=())
        prompts = [[5, 17, 33, 2], [9]]
        outputs = [
            [r.token_ids for r in Generator(m, fuse_blocks=False).generate(prompts, params).results]
            for m in (reference, model)
        ]
        assert outputs[0] == outputs[1]


def sdpa_decode(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_len):
    """`decode_attention` as the model's own code does it: RoPE, the cache write, SDPA over
    slots 0..kv_len-1 with the decode step's mask."""
    from lmforge.models.llama.model import apply_rope
    from lmforge.modules.kv_cache import attention_mask

    batch, kv_heads, head_dim = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    q, k, v = qkv[:, None].split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = apply_rope(q.unflatten(-1, (heads, head_dim)), cos[:, None], sin[:, None])
    k = apply_rope(k.unflatten(-1, (kv_heads, head_dim)), cos[:, None], sin[:, None])
    v = v.unflatten(-1, (kv_heads, head_dim))
    rows = torch.arange(batch)
    k_cache[rows, :, positions], v_cache[rows, :, positions] = k[:, 0], v[:, 0]
    mask = attention_mask(positions[:, None], kv_len)
    keys, values = k_cache[:batch, :, :kv_len], v_cache[:batch, :, :kv_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2).flatten(1)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,positions,kv_len,split",
    [
        (6, 2, 16, [5], 8, 256),  # one split; a GQA group of 3
        (4, 4, 32, [0, 37], 40, 16),  # no GQA; the first slot; three splits
        (8, 2, 64, [63, 17, 2], 64, 16),  # rows at their own positions; four splits
        (4, 2, 16, [70, 3], 48, 16),  # a row beyond kv_len: its slot is still written
        (32, 8, 64, [1000], 1024, 64),  # the 1B's heads, 16 splits
        (24, 8, 128, [300, 511], 512, 64),  # the 3B's heads, 8 splits
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attention_equals_sdpa(
    heads, kv_heads, head_dim, positions, kv_len, split, dtype, monkeypatch
):
    """RoPE, the cache write and attention in one kernel (slots split over programs and
    merged) equal the model's RoPE, an indexed write and SDPA with the decode mask; slots
    beyond a row's position hold stale values that must not be read."""
    from lmforge.generate import decode_attention as da

    monkeypatch.setattr(da, "SPLIT_SLOTS", split)
    monkeypatch.setattr(da, "BLOCK_SLOTS", 16 if kernels.INTERPRETED else 64)
    g = torch.Generator().manual_seed(heads * head_dim + kv_len)
    batch = len(positions)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(batch, head_dim // 2, generator=g) * 6
    cos, sin = (torch.cat([f(angles), f(angles)], -1).to(dtype) for f in (torch.cos, torch.sin))
    slots = max(80, kv_len + 8)
    caches = [torch.randn(4, kv_heads, slots, head_dim, generator=g).to(dtype) for _ in range(2)]
    want_caches = [c.clone() for c in caches]
    positions = torch.tensor(positions)
    # On a GPU without the interpreter (TRITON_INTERPRET=0) the compiled kernel runs, twice (a
    # second run rewrites the new slots and reads the same).
    on_device = [t.to(DEVICE) for t in (qkv, cos, sin, *caches, positions)]
    for _ in range(1 if kernels.INTERPRETED else 2):
        got = da.decode_attention(*on_device, heads, kv_len).cpu()
    caches = [c.cpu() for c in on_device[3:5]]
    want = sdpa_decode(qkv, cos, sin, *want_caches, positions, heads, kv_len)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {}
    for got_cache, want_cache in zip(caches, want_caches):
        torch.testing.assert_close(got_cache, want_cache, **tolerance)
    decoding = positions < kv_len  # the others' output is ignored by the engine
    torch.testing.assert_close(got[decoding], want[decoding], **tolerance)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_fused_blocks_attend_in_one_kernel_through_the_engine(family, monkeypatch):
    """A batch-1 decode through the engine runs each fused block's attention in
    `decode_attention` (its slots split over programs once the sequence passes 16; Qwen3's
    per-head q / k norms inside it; a MoE's sparse blocks fused in their attention half) and
    decodes the unfused model's greedy tokens."""
    import copy

    from lmforge.generate import Generator, SamplingParams
    from lmforge.generate import decode_attention as da
    from tests.train_utils import small_family_args

    monkeypatch.setattr(da, "SPLIT_SLOTS", 16)
    monkeypatch.setattr(da, "BLOCK_SLOTS", 16)
    kv_lengths = []

    def counted(*args, **kwargs):
        kv_lengths.append(args[7])
        return da.decode_attention(*args, **kwargs)

    monkeypatch.setattr(fused_block, "decode_attention", counted)
    args = SMALL if family == "llama" else small_family_args(family, head_dim=32)
    model = build_model(args, dtype=torch.float32, seed=0)
    model.fuse_projections()
    reference = copy.deepcopy(model)  # nn.Linear and SDPA (quicker than the interpreter)
    use_gemv(model)
    assert kernels.use_fused_blocks(model) == args.num_layers
    # a 14-token prompt (prefilled by the blocks' own forward), then decode steps past slot 16
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=())
    prompt = [5, 17, 33, 2, 9, 41, 7, 12, 88, 3, 60, 21, 4, 15]
    outputs = [
        Generator(m, max_batch=1, fuse_blocks=False).generate([prompt], params).results
        for m in (reference, model)
    ]
    assert outputs[0][0].token_ids == outputs[1][0].token_ids
    assert len(kv_lengths) >= 5 * args.num_layers and max(kv_lengths) > 16


@pytest.mark.skipif(kernels.INTERPRETED, reason="a GPU's compiled kernels (TRITON_INTERPRET=0)")
def test_early_launch_decodes_the_tokens_of_ordered_launch(monkeypatch):
    """On a GPU (sm_90+), the compiled batch-1 step with its kernels launched early (each
    waiting for the one before; `early_launch.py`) and its weights preloaded decodes the same
    greedy tokens as with every kernel launched in order: the tiles are tuned once a process,
    so the two runs differ only in the launch, and a kernel reading its input too soon would
    show as another token. bf16 and int8, a 1B-wide model of 2 layers."""
    from lmforge.generate import Generator, SamplingParams, early_launch
    from lmforge.quantize.quantize import QuantSpec, quantize_model

    assert early_launch.early_launch(torch.device("cuda")), "needs sm_90 or later"
    args = get_preset("llama3.2-1b").replace(num_layers=2)
    params = SamplingParams(max_new_tokens=48, temperature=0, stop_token_ids=())
    for scheme in ("bf16", "int8-wo"):
        tokens = []
        for enabled in (True, False):
            monkeypatch.setattr(early_launch, "ENABLED", enabled)
            model = build_model(args, device="cuda", dtype=torch.bfloat16, seed=0)
            if scheme != "bf16":
                quantize_model(model, QuantSpec(scheme))
            generator = Generator(model, max_batch=1, max_seq_len=64, device="cuda")
            result = generator.generate([[5, 17, 33, 2]], params).results[0]
            tokens.append(result.token_ids)
        assert tokens[0] == tokens[1], scheme


def test_linears_with_hooks_stay():
    """A linear with hooks (tensor parallelism's all-reduce after wo and w2) keeps them: the
    swaps pass it by, and so its block is not fused."""
    model = build_model(SMALL.replace(num_layers=1), dtype=torch.bfloat16, seed=0)
    assert model.fuse_projections()
    wo = model.layers["0"].attention.wo
    wo.register_forward_hook(lambda module, inputs, output: output)
    assert use_gemv(model) == 4  # wqkv, w13, w2, output
    assert model.layers["0"].attention.wo is wo
    assert kernels.use_fused_blocks(model) == 0


COMPILE_FOR_SM90 = """
import itertools, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmforge.generate.kernels import gemv_kernel, int4, ops

target = GPUTarget("cuda", 90, 32)
pointers = ["x_ptr", "w_ptr", "scale_ptr", "zero_ptr", "norm_ptr", "residual_ptr", "y_ptr",
            "partial_ptr", "count_ptr"]
flags = ["GROUP", "BITS", "NORM", "GATED", "RESIDUAL", "BLOCK_N", "BLOCK_K", "X_TILE", "EARLY",
         "PRELOAD", "INT4_FROM_BITS", "INT8_BIASED", "SWIGLU", "SPLITS", "MAX_SPLITS", "FOLD"]
cases = [  # (bits, group, fusions, x_tile, tile): what the engine's blocks and harness launch
    (16, 2048, "NORM", True, (8, 1024, 8)), (16, 2048, "GATED RESIDUAL", False, (8, 128, 4)),
    (16, 2048, "RESIDUAL", False, (2, 1024, 4)), (8, 2048, "NORM", True, (8, 1024, 8)),
    (8, 2048, "", False, (8, 128, 4)), (8, 128, "RESIDUAL", True, (8, 128, 4)),
    (4, 128, "NORM", True, (16, 128, 8)), (4, 128, "GATED RESIDUAL", False, (8, 128, 4)),
    (16, 8192, "GATED RESIDUAL", False, (8, 1024, 4)), (8, 2048, "NORM SWIGLU", False, (8, 512, 4)),
    (16, 2048, "NORM SWIGLU", True, (8, 1024, 8)), (8, 8192, "RESIDUAL SPLITS", True, (2, 1024, 4)),
    (8, 8192, "RESIDUAL FOLD", True, (16, 1024, 2)), (8, 2048, "NORM SWIGLU FOLD", True, (16, 1024, 4)),
    (8, 2048, "NORM SWIGLU FOLD OFFSET", True, (16, 1024, 4)), (8, 2048, "RESIDUAL OFFSET", False, (8, 1024, 4)),
]
for bits, group, fusions, x_tile, (block_n, block_k, warps) in cases:
    weight = {16: "*bf16", 8: "*u8" if "OFFSET" in fusions else "*i8", 4: "*u8"}[bits]  # q + 128
    signature = {name: "*bf16" for name in pointers} | {"w_ptr": weight}
    signature |= {"partial_ptr": "*fp32", "count_ptr": "*i32"}
    signature |= {"N": "i32", "eps": "fp32"} | {name: "constexpr" for name in flags + ["K"]}
    signature = {name: signature[name] for name in gemv_kernel._gemv.arg_names}
    constants = {"GROUP": group, "BITS": bits, "BLOCK_N": block_n, "BLOCK_K": block_k}
    constants["K"] = max(group, 2048)
    early = fusions != ""  # launched early (the fused products), the first weights loaded first
    constants |= {"X_TILE": x_tile, "EARLY": early, "PRELOAD": (2 if bits == 16 else 1) * early}
    constants["INT4_FROM_BITS"] = bits == 4 and fusions == "NORM"  # (its PTX; the other int4: not)
    constants["INT8_BIASED"] = bits == 8 and group == 2048 and not x_tile  # (and one exact)
    constants |= {name: name in fusions.split() for name in ("NORM", "GATED", "RESIDUAL", "SWIGLU")}
    constants |= {"SPLITS": 1 + ("SPLITS" in fusions), "MAX_SPLITS": 4, "FOLD": "FOLD" in fusions}
    names = list(signature)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers + ["N"]}
    source = ASTSource(gemv_kernel._gemv, signature, constexprs=constants, attrs=aligned)
    options = {"num_warps": warps, "num_stages": 3, "launch_pdl": early}
    ptx = triton.compile(source, target=target, options=options).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == early, (bits, fusions)
    assert ("atom.global.gpu.acq_rel.add" in ptx) == ("SPLITS" in fusions), (bits, fusions)
    if early:  # the first weight tile is asked for before the wait
        assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait"), (bits, fusions)
for bits, weight in ((8, "*i8"), (8, "*u8"), (4, "*u8")):
    signature = {"w_ptr": weight, "scale_ptr": "*bf16", "zero_ptr": "*bf16",
                 "out_ptr": "*bf16", "N": "i32"}
    signature |= {name: "constexpr" for name in ("K", "GROUP", "BITS", "BLOCK_N", "BLOCK_K")}
    constants = {"K": 4096, "GROUP": 128, "BITS": bits, "BLOCK_N": 64, "BLOCK_K": 128}
    triton.compile(ASTSource(ops._dequantize, signature, constexprs=constants), target=target)
for fusions, (block_n, groups, warps) in (("NORM SWIGLU", (32, 4, 4)), ("RESIDUAL", (16, 2, 2)),
                                          ("GATED RESIDUAL SPLITS", (8, 4, 1)), ("", (16, 1, 2))):
    signature = {name: "*bf16" for name in pointers} | {"w_ptr": "*i32", "N": "i32", "eps": "fp32"}
    signature |= {"partial_ptr": "*fp32", "count_ptr": "*i32"}
    constants = {"K": 2048, "GROUP": 128, "BLOCK_N": block_n, "GROUPS": groups, "EARLY": True,
                 "PRELOAD": 1, "DOWN": 2.0**-4, "UP": 16.0}
    constants |= {name: name in fusions.split() for name in ("NORM", "GATED", "RESIDUAL", "SWIGLU")}
    constants |= {"SPLITS": 1 + ("SPLITS" in fusions), "MAX_SPLITS": 4}
    signature |= {name: "constexpr" for name in constants}
    signature = {name: signature[name] for name in int4._gemv_int4.arg_names}
    source = ASTSource(int4._gemv_int4, signature, constexprs=constants)
    ptx = triton.compile(source, target=target, options={"num_warps": warps, "launch_pdl": True}).asm["ptx"]
    assert "fma.rn.f16x2" in ptx and ptx.index("ld.global") < ptx.index("griddepcontrol.wait")
    assert ("atom.global.gpu.acq_rel.add" in ptx) == ("SPLITS" in fusions), fusions
from lmforge.generate import decode_attention as da
for dtype, head_dim, group in (("bf16", 64, 4), ("bf16", 128, 3), ("fp32", 64, 4)):
    signature = {name: "*" + dtype for name in ("qkv_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr",
                                                "v_cache_ptr", "out_ptr")}
    signature |= {"positions_ptr": "*i64", "partial_ptr": "*fp32", "stats_ptr": "*fp32"}
    signature |= {"qkv_row_stride": "i32", "cache_row_stride": "i32", "cache_head_stride": "i32",
                  "split_slots": "i32", "splits": "i32", "scale": "fp32", "eps": "fp32",
                  "q_norm_ptr": "*" + dtype, "k_norm_ptr": "*" + dtype}
    early = dtype == "bf16"
    constants = {"HEADS": 8 * group, "KV_HEADS": 8, "HEAD_DIM": head_dim, "GROUP_ROWS": 16,
                 "BLOCK_SLOTS": da.BLOCK_SLOTS, "EXACT": dtype == "fp32", "EARLY": early,
                 "QK_NORM": head_dim == 128}
    signature = {**signature, **{name: "constexpr" for name in constants}}
    source = ASTSource(da._decode_attention, {n: signature[n] for n in da._decode_attention.arg_names},
                       constexprs=constants)
    options = {"num_warps": 4, "num_stages": 2, "launch_pdl": constants["EARLY"]}
    ptx = triton.compile(source, target=target, options=options).asm["ptx"]
    assert ("griddepcontrol.launch_dependents" in ptx) == early
signature = {"partial_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16", "splits": "i32",
             "HEAD_DIM": "constexpr", "SPLITS": "constexpr", "EARLY": "constexpr"}
source = ASTSource(da._combine, signature, constexprs={"HEAD_DIM": 64, "SPLITS": 32, "EARLY": True})
assert "griddepcontrol.wait" in triton.compile(source, target=target).asm["ptx"]
from lmforge.generate.kernels import quantized_gemm as qg
products = 0
for (bits, weight, scale), swap, fast in itertools.product(  # what the engine's int8 and int4 hold
        ((8, "*u8", "*fp32"), (8, "*i8", "*bf16"), (4, "*u8", "*bf16")), (False, True), (False, True)):
    signature = {name: "*bf16" for name in ("x_ptr", "y_ptr")} | {"q_ptr": weight}
    signature |= {"scale_ptr": scale, "zero_ptr": scale, "partial_ptr": "*fp32", "count_ptr": "*i32"}
    signature |= {name: "i32" for name in ("M", "N", "STORED", "stride_x")}
    constants = {"GROUP": 128, "BITS": bits, "MAX_ROWS": 128, "BLOCK_M": 64, "BLOCK_N": 64,
                 "BLOCK_K": 64, "SPLIT_K": 2, "PRECISION": "tf32", "INTERPRETED_DOT": False,
                 "SWAP": swap, "FAST": fast}
    signature |= {name: "constexpr" for name in constants}
    signature = {name: signature[name] for name in qg._quantized_gemm.fn.arg_names}
    source = ASTSource(qg._quantized_gemm.fn, signature, constexprs=constants)
    assert "wgmma" in triton.compile(source, target=target).asm["ptx"], (bits, swap, fast)
    products += 1
print("compiled", len(cases) + 3 + 4 + 4 + products)
"""


def test_the_kernels_compile_for_a_gpu():
    """The interpreter runs code the GPU compiler refuses (e.g. returns of two shapes from one
    function), so the kernels are also compiled, without a GPU, for an H100/H200 (sm_90) with
    the ptxas that Triton ships, in a process without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 39" in done.stdout


def _product(key: str) -> dict:
    """The autotuner's arguments for a product named as in the tiles table (no BITS: int4 in
    packed fp16, `_gemv_int4`'s)."""
    n, k, bits, group, *fusions = key.split()
    named = {"N": int(n), "K": int(k), "GROUP": int(group)}
    named |= {"BITS": int(bits.removesuffix("f"))} if bits != "4h" else {}
    weights = {"16": torch.bfloat16, "8": torch.int8, "8f": torch.float8_e4m3fn}
    named["w_ptr"] = torch.empty(1, dtype=weights.get(bits, torch.uint8))
    named["x_ptr"] = torch.empty(1, dtype=torch.bfloat16)
    flags = {name: name.lower() in fusions for name in ("NORM", "GATED", "RESIDUAL", "SWIGLU")}
    max_splits = tiles._max_splits(True if flags["NORM"] else None, flags["SWIGLU"])
    return named | flags | {"MAX_SPLITS": max_splits}


def test_a_pinned_tile_is_the_only_one_tuned(tmp_path, monkeypatch, caplog):
    """A product the tiles table names runs that tile (the autotuner gets one config); one it
    does not name, or a pin that is not among the product's candidates, gets the candidates;
    LMFORGE_GEMV_TILES=none pins nothing; a table that cannot be read pins nothing, with a
    warning that names it."""
    configs = tiles._gemv_configs()
    product = _product("3072 2048 8 2048 norm")
    named = {"w_ptr": torch.empty(1, dtype=torch.int8), "N": 3072, "K": 2048}
    named["x_ptr"] = product["x_ptr"]
    flags = {name: product[name] for name in ("BITS", "GROUP", "NORM", "GATED", "RESIDUAL")}
    candidates = tiles._candidates(configs, product)
    assert len(candidates) > 4 and tiles.tile_key(product) == "3072 2048 8 2048 norm"
    described = [tiles.describe(c) for c in candidates]  # int8 of a scale a row: both ways
    assert {" biased" in d for d in described} == {True, False}
    fp32 = tiles._candidates(configs, product | {"x_ptr": torch.empty(1)})
    as_biased = [  # each fp32 candidate is a bf16 one without the bias
        tiles.describe(triton.Config(c.kwargs | {"INT8_BIASED": True}, c.num_warps, c.num_stages))
        for c in fp32
    ]
    assert as_biased == [d for d in described if " biased" in d]
    table = tmp_path / "tiles.json"
    pinned = tiles.describe(candidates[3])
    table.write_text(json.dumps({"cpu": {"3072 2048 8 2048 norm": pinned, "16 16 8 16": "x"}}))
    monkeypatch.setenv("LMFORGE_GEMV_TILES", str(table))
    tiles.pinned_tiles.cache_clear()
    try:
        assert [tiles.describe(c) for c in tiles._fits(configs, named, **flags)] == [pinned]
        other = flags | {"NORM": False}  # not in the table
        assert tiles._fits(configs, named, **other) == tiles._candidates(configs, named | other)
        table.write_text(json.dumps({"cpu": {"3072 2048 8 2048 norm": "3x7 vec w1 s9"}}))
        tiles.pinned_tiles.cache_clear()
        assert tiles._fits(configs, named, **flags) == candidates
        monkeypatch.setenv("LMFORGE_GEMV_TILES", "none")
        tiles.pinned_tiles.cache_clear()
        assert tiles._fits(configs, named, **flags) == candidates
        for bad in ("{not json", '["a list"]', '{"cpu": {"3072 2048 8 2048 norm": 7}}', None):
            if bad is not None:
                table.write_text(bad)
            path = table if bad is not None else tmp_path / "missing.json"
            monkeypatch.setenv("LMFORGE_GEMV_TILES", str(path))
            tiles.pinned_tiles.cache_clear()
            with caplog.at_level("WARNING", logger="lmforge.generate.kernels.tiles"):
                assert tiles._fits(configs, named, **flags) == candidates
            assert f"LMFORGE_GEMV_TILES={path}" in caplog.text and "tuning every" in caplog.text
            caplog.clear()
    finally:
        tiles.pinned_tiles.cache_clear()


def test_the_tuner_compiles_every_candidate_on_threads_before_timing(monkeypatch, caplog):
    """Before timing a product's candidates, the tuner compiles each (a warm-up run of its
    config) under Triton's async compile mode, which hands the compiles to threads; if that
    fails, the candidates are still timed (compiling one by one), with a warning; one
    candidate, or one thread, compiles nothing ahead."""
    from triton.runtime import _async_compile

    events = []

    class Kernel:  # stands for the @triton.jit function: records its runs
        arg_names = ("x_ptr", "N")
        fail = False
        fn = staticmethod(lambda x_ptr, N: None)  # (the Python function Triton's tuner names)

        def run(self, *args, grid, warmup, **kwargs):
            assert args == ("x", 64) and grid == (4,)
            if self.fail:
                raise RuntimeError("no compile mode here")
            threaded = _async_compile.active_mode.get() is not None
            events.append(("compiled" if warmup else "ran", kwargs["BLOCK_N"], threaded))

    configs = [triton.Config({"BLOCK_N": n}, num_warps=4) for n in (8, 16, 32)]
    monkeypatch.setattr(tiles, "COMPILE_THREADS", 4)
    kernel = Kernel()
    tuner = tiles.autotune(configs, key=["N"], prune=lambda c, named, **kw: c)(kernel)
    tuner._launch = (("x", 64), {"grid": (4,), "warmup": False})
    # a call without a tuning key times its candidates at once (no cache lookup, no GPU)
    tuner.check_disk_cache((), configs, lambda: events.append("timed"))
    assert events == [("compiled", n, True) for n in (8, 16, 32)] + ["timed"]
    events.clear()
    kernel.fail = True
    with caplog.at_level("WARNING", logger="lmforge.generate.kernels.tiles"):
        tuner.check_disk_cache((), configs, lambda: events.append("timed"))
    assert events == ["timed"] and "compiling 3 tiles on threads failed" in caplog.text
    kernel.fail = False
    events.clear()
    tuner.check_disk_cache((), configs[:1], lambda: events.append("timed"))
    monkeypatch.setattr(tiles, "COMPILE_THREADS", 1)
    tuner.check_disk_cache((), configs, lambda: events.append("timed"))
    assert events == ["timed", "timed"]


# The tuner's compile ahead through Triton itself, without a GPU: a stand-in driver answers what
# compiling asks (an sm_90 target, device 0); nothing is launched. Run in a process without
# TRITON_INTERPRET (`test_the_tuner_compiles_for_a_gpu_on_threads`).
TUNE_FOR_SM90 = """
import sys
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

class Sm90:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")

driver.set_active(Sm90())
from lmforge.generate.kernels import gemv_kernel, tiles

tiles.COMPILE_THREADS = 2
n, k = 512, 1024  # int8 of a scale a row, with its norm (as wqkv)
x, norm = torch.empty(k, dtype=torch.bfloat16), torch.empty(k, dtype=torch.bfloat16)
w, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, 1)
y, partial, count = torch.empty(n, dtype=torch.bfloat16), torch.empty(n), torch.empty(n, dtype=torch.int32)
args = (x, w, scale, y, norm, y, y, partial, count, n, k, 1e-5)
flags = dict(GROUP=k, BITS=8, NORM=True, GATED=False, RESIDUAL=False, SWIGLU=False, EARLY=True,
             PRELOAD=2, INT4_FROM_BITS=False, MAX_SPLITS=1)
tuner = gemv_kernel._gemv_tuned
configs = tiles._candidates(tuner.configs, {**dict(zip(tuner.arg_names, args)), **flags})[:6]
tuner._launch = (args, {**flags, "launch_pdl": True, "grid": (1,), "warmup": False})

def timed():  # stands for timing each candidate on the GPU
    assert len(kernels) == 6, "every candidate compiled before the timing"
    tuner.configs_timings = {config: [float(i)] * 3 for i, config in enumerate(configs)}
    tuner.cache[key] = configs[0]

kernels, key = gemv_kernel._gemv.device_caches[0][0], (n, k, "test")
assert not tuner.check_disk_cache(key, configs, timed)  # tuned, and the picks kept
kernels.clear()
assert tuner.check_disk_cache(key, configs, lambda: sys.exit("timed again"))
assert len(kernels) == 0, "picks read from the cache compile nothing"
print("compiled", len(configs), "on threads")
"""


def test_the_tuner_compiles_for_a_gpu_on_threads(tmp_path):
    """Through Triton itself (its compiler for sm_90, its async compile mode, its cache of
    picks), without a GPU: the tuner compiles every candidate of a product on threads into the
    kernel's cache before timing them, keeps the picks in Triton's cache directory, and a
    second tune reads them there and compiles nothing."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", TUNE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 6 on threads" in done.stdout


def test_the_shipped_tiles_are_candidates():
    """Every tile of lmforge/generate/gemv_tiles.json is one its product's autotuner would try
    (a stale pin would be ignored silently)."""
    table = json.loads(tiles.TILES.read_text())
    configs, int4_configs = tiles._gemv_configs(), tiles._int4_configs()
    for gpu, pins in table.items():
        for key, pin in pins.items():
            product = _product(key)
            if "BITS" in product:
                candidates = tiles._candidates(configs, product)
            else:
                candidates = tiles._int4_candidates(int4_configs, product)
            tried = [tiles.describe(c) for c in candidates]
            assert pin in tried, (gpu, key, pin, tried)


@pytest.mark.parametrize(
    "bits,group", [(8, 64), (4, 64), (4, 256)], ids=["int8", "int4", "int4-row"]
)
@pytest.mark.parametrize("rows", [2, 17, 40])
@pytest.mark.parametrize("swap", [False, True], ids=["x-left", "w-left"])
def test_the_tiled_product_of_several_rows_equals_the_dequantized_one(
    bits, group, rows, swap, monkeypatch
):
    """`quantized_gemm` (weights dequantized tile by tile, split over K, in fp32 here: IEEE
    products) against x @ the dequantized weight; rows 17 and 40: partly masked row tiles;
    the weight tile as either operand of the product."""
    from lmforge.generate.kernels import quantized_gemm

    monkeypatch.setitem(quantized_gemm.VARIANT, "swap", swap)
    n, k = 40, 512
    q, scale, zero = random_layout(bits, n, k, group)
    packed = (q[:, : k // 2] | (q[:, k // 2 :] << 4)) if bits == 4 else q
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    on = [t.to(DEVICE) for t in (x, packed, scale, zero)]
    assert quantized_gemm.supported(on[0], on[1], on[2], bits)
    got = quantized_gemm.quantized_gemm(*on, bits).cpu()
    expected = x @ dequantized(bits, q, scale, zero).t()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert not quantized_gemm.supported(on[0][:1], *on[1:3], bits)  # one row: the GEMV's
    many = on[0].new_empty(quantized_gemm.MAX_ROWS + 1, k)
    assert not quantized_gemm.supported(many, *on[1:3], bits)  # prefill: expansion + cuBLAS


@pytest.mark.skipif(kernels.INTERPRETED, reason="a GPU's compiled kernels (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("bits,group", [(8, 4096), (4, 128)], ids=["int8", "int4"])
@pytest.mark.parametrize("rows", [3, 64])
@pytest.mark.parametrize("swap", [False, True], ids=["x-left", "w-left"])
@pytest.mark.parametrize("fast", [False, True], ids=["fp32-dequant", "bf16-dequant"])
def test_the_tiled_product_of_bf16_rows_is_within_bf16_rounding(bits, group, rows, swap, fast,
                                                                 monkeypatch):  # fmt: skip
    """On a GPU, bf16 activations (the engine's): each variant's product against x @ the
    weight dequantized in fp32 and rounded once to bf16, within bf16 products' rounding."""
    from lmforge.generate.kernels import quantized_gemm

    monkeypatch.setitem(quantized_gemm.VARIANT, "swap", swap)
    monkeypatch.setitem(quantized_gemm.VARIANT, "fast", fast)
    n, k = 1024, 4096
    q, scale, zero = random_layout(bits, n, k, group)
    scale, zero = scale.bfloat16(), zero.bfloat16()
    packed = (q[:, : k // 2] | (q[:, k // 2 :] << 4)) if bits == 4 else q
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    on = [t.to(DEVICE) for t in (x, packed, scale, zero)]
    got = quantized_gemm.quantized_gemm(*on, bits).float().cpu()
    expected = x.float() @ dequantized(bits, q, scale, zero).bfloat16().float().t()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
