"""The inference planner (lmforge/plan/inference.py) against the real tensors of a tiny model on
the CPU (parameters, torchao's quantized weights, the engine's KV cache) and by arithmetic."""

from __future__ import annotations

import pytest
import torch

from lmforge import models
from lmforge.errors import ConfigError
from lmforge.models import ModelArgs
from lmforge.plan.inference import (
    InferenceSetup,
    kv_cache_bytes,
    plan_inference,
    weight_bytes,
)
from lmforge.plan.memory import GiB

TINY = ModelArgs(
    dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=192, vocab_size=256, max_seq_len=128
)


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, a torchao weight counted by its flattened parts."""
    total = 0
    for param in model.parameters():  # a tied weight once
        if type(param) in (torch.Tensor, torch.nn.Parameter):
            total += param.numel() * param.element_size()
            continue
        names, _ = param.__tensor_flatten__()
        total += sum(getattr(param, n).numel() * getattr(param, n).element_size() for n in names)
    return total


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_weight_bytes_equal_the_parameters(tied, dtype):
    args = TINY.replace(tie_embeddings=tied)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = models.new_model(args).to(torch_dtype)
    assert weight_bytes(InferenceSetup(args=args, dtype=dtype)) == tensor_bytes(model)


@pytest.mark.parametrize(
    "scheme,group,output",
    [
        ("int8-wo", None, False),
        ("int8-wo", 32, True),
        ("int4-wo", 32, False),
        ("int4-wo", 64, True),
        ("int4-wo", None, False),  # the group quantize chooses: 64 (256 does not divide dim 64)
    ],
)
def test_quantized_weight_bytes_equal_torchao_tensors(scheme, group, output):
    pytest.importorskip("torchao")
    from lmforge.quantize.quantize import QuantSpec, quantize_model

    model = models.new_model(TINY).to(torch.bfloat16)
    quantize_model(model, QuantSpec(scheme, group_size=group, quantize_output=output), device="cpu")
    setup = InferenceSetup(
        args=TINY,
        quantization=scheme,
        group_size=group,
        quantize_output=output,
        int4_packed=False,  # made on the CPU
    )
    assert weight_bytes(setup) == tensor_bytes(model)


def test_kv_cache_bytes_equal_the_engines_cache():
    from lmforge.generate.engine import Engine
    from lmforge.modules.kv_cache import KVCaches

    model = models.new_model(TINY).to(torch.bfloat16)
    engine = Engine(model, max_batch=3, max_seq_len=48, compile=False)
    setup = InferenceSetup(args=TINY, batch=3, seq_len=48)
    assert kv_cache_bytes(setup) == engine.caches.num_bytes
    # tensor parallel: each process holds its kv heads' share
    half = KVCaches.for_model(
        TINY, max_batch=3, max_seq_len=48, dtype=torch.bfloat16, device="cpu", num_kv_heads=1
    )
    assert kv_cache_bytes(setup.replace(tp=2)) == half.num_bytes


def test_llama_70b_by_arithmetic():
    args = models.PRESETS["llama3.1-70b"]
    one = InferenceSetup(args=args, batch=8, seq_len=4096)
    # 70.6e9 parameters in bf16; the cache: 80 layers × k,v × 8 rows × 8 kv heads × 4096 × 128
    assert weight_bytes(one) == 2 * args.num_params()
    assert kv_cache_bytes(one) == 80 * 2 * 8 * 8 * 4096 * 128 * 2
    tp8 = one.replace(tp=8)
    norms = 2 * args.dim * (2 * args.num_layers + 1)  # whole on every GPU
    assert weight_bytes(tp8) == (weight_bytes(one) - norms) // 8 + norms
    assert kv_cache_bytes(tp8) == kv_cache_bytes(one) // 8
    assert not plan_inference(one, "80GB").fits
    plan = plan_inference(tp8, "80GB")
    assert plan.fits and 18 * GiB < plan.total < 30 * GiB
    int4 = plan_inference(one.replace(quantization="int4-wo", group_size=256), "80GB")
    # tinygemm: half a byte per value (~35 GiB) + the bf16 embedding and output + 10 GiB of cache
    assert int4.fits and 45 * GiB < int4.total < 60 * GiB
    # decode's float32 logits [rows, vocab] are in the decode phase
    assert plan.phases["decode"]["decode step"] > 8 * args.vocab_size * 4


def test_refusals():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        plan_inference(InferenceSetup(args=TINY, tp=4))
    with pytest.raises(ConfigError, match="quantized"):
        plan_inference(InferenceSetup(args=TINY, tp=2, quantization="int4-wo"))


def test_quantized_products_of_many_rows_plan_the_expanded_weight():
    """More than 128 rows through a quantized linear (a prefill chunk, a scoring batch) expand
    its weight to bf16 first (lmforge/generate/kernels/): the largest, the fused gate/up;
    decoding up to 128 sequences (the GEMV, `quantized_gemm`) needs none."""
    setup = InferenceSetup(args=TINY, quantization="int8-wo", task="eval", batch=64)
    plan = plan_inference(setup)
    fused_gate_up = 2 * (2 * TINY.ffn_dim * TINY.dim)
    assert plan.phases["prefill"]["expanded weight"] == fused_gate_up
    assert plan.phases["scoring forward"]["expanded weight"] == fused_gate_up
    assert "expanded weight" not in plan.phases["decode"]
    assert plan_inference(setup.replace(batch=200)).phases["decode"]["expanded weight"]
    assert (
        "expanded weight" not in plan_inference(setup.replace(quantization=None)).phases["prefill"]
    )


def test_the_planner_knows_how_many_rows_skip_the_expansion():
    pytest.importorskip("triton")
    from lmforge.generate.kernels.quantized_gemm import MAX_ROWS
    from lmforge.plan.inference import QUANTIZED_GEMM_ROWS

    assert QUANTIZED_GEMM_ROWS == MAX_ROWS


def test_a_gptq_stage_is_planned_on_the_host():
    """`quantize --method gptq` runs llm-compressor on the CPU: no GPU memory; the host holds
    the model as stored, one block's Hessians and the samples' hidden states (8B, 128 × 512:
    16.1 GB of bf16 weights + 1.2 GB of Hessians + 2.1 GB of activations)."""
    from lmforge.plan.inference import format_inference_plan

    args = models.get_preset("llama3.1-8b")
    setup = InferenceSetup(args=args, task="quantize", calibrated=True, batch=128, seq_len=512)
    plan = plan_inference(setup, "h100")
    assert plan.total == 0 and plan.fits
    hessians = 4 * (5 * 4096**2 + 4096**2 + 14336**2)
    assert plan.host_bytes == args.num_params() * 2 + hessians + 8 * 128 * 512 * 4096
    assert "GPTQ of a 8.0B model on the host" in format_inference_plan(plan)


def test_fp8_weight_bytes_equal_the_loaded_artifacts(tmp_path):
    """An fp8 artifact as `lmforge.load` holds it (torchao's Float8Tensor: a byte a value, an
    fp32 scale a row) weighs what the planner counts; its prefill expands nothing."""
    pytest.importorskip("compressed_tensors")
    import lmforge
    from lmforge.api import LoadedModel
    from lmforge.cli import main as cli_main
    from lmforge.plan.inference import expanded_weight_bytes

    model = models.new_model(TINY).to(torch.bfloat16)
    source = lmforge.save(LoadedModel(model, None, TINY, "tiny"), tmp_path / "bf16", stage="test")
    assert cli_main(["quantize", str(source), str(tmp_path / "fp8"), "--scheme", "fp8"]) == 0
    loaded = lmforge.load(tmp_path / "fp8").model
    setup = InferenceSetup(args=TINY, quantization="fp8")
    assert weight_bytes(setup) == tensor_bytes(loaded)
    assert expanded_weight_bytes(setup, rows=4096) == 0
