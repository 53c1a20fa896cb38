"""Memory planner (lmforge.plan): the seed's arithmetic, activations against what autograd really
saves, the dry run's sharded sizes against the arithmetic, search / suggestions, and the CLI.

The GPU side (predicted vs measured peak memory of real training steps) is
benchmarks/memory.py, run on the device machine.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from lmforge import cli
from lmforge.errors import ConfigError
from lmforge.models import get_preset
from lmforge.modules.lora import apply_lora
from lmforge.plan import (
    Setup,
    bytes_per_param,
    dry_run,
    model_state_bytes,
    parse_memory,
    plan_job,
    plan_memory,
    search,
    suggest,
)
from lmforge.plan import memory as plan_memory_module
from lmforge.plan.memory import GiB, TiB, head_activations, layer_activations

LLAMA_70B = get_preset("llama3.1-70b")
H100 = parse_memory("h100")


def tiny_args(family: str = "llama", **changes):
    shape = dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=160, vocab_size=250)
    if family == "qwen3":  # q/k head norms, head_dim 24 != dim / heads, untied like tiny
        shape |= dict(head_dim=24, tie_embeddings=False)
    return get_preset({"llama": "tiny", "qwen3": "qwen3-0.6b"}[family]).replace(**(shape | changes))


# ---- the seed's numbers --------------------------------------------------------------------


def test_seed_18_bytes_per_parameter_and_1_15_tib():
    setup = Setup(args=LLAMA_70B, method="full", gpus=16)  # FSDP2: fp32 weights, bf16 gathers
    assert bytes_per_param(setup) == {"parameters": 6, "gradients": 4, "optimizer states": 8}
    # one GPU: bf16 weights and gradients, AdamW's moments and the fp32 masters
    one = setup.replace(gpus=1)
    assert bytes_per_param(one) == {"parameters": 2, "gradients": 2, "optimizer states": 12}
    assert not one.autocast and one.residual_bytes == 2
    assert bytes_per_param(one.replace(bf16_params=False))["parameters"] == 6
    assert one.replace(grad_accumulation=4).master_weights  # the micro-batches sum in fp32
    total = model_state_bytes(setup, num_params=70e9)
    assert total == 1_260_000_000_000
    assert f"{total / TiB:.2f}" == "1.15"
    # The preset's exact count: 70.55B parameters.
    assert model_state_bytes(setup) == 18 * LLAMA_70B.num_params()
    assert sum(bytes_per_param(setup.replace(optimizer="sgd")).values()) == 14
    assert sum(bytes_per_param(setup.replace(param_dtype="bf16")).values()) == 2 + 2 + 4


def test_seed_setups_verdicts():
    # Full finetune of Llama 3 70B, FSDP + CPU offload + activation checkpointing, 2×8 H100.
    offload = Setup(
        args=LLAMA_70B,
        method="full",
        gpus=16,
        activation_checkpointing="full",
        cpu_offload=True,
    )
    plan = plan_memory(offload, H100)
    assert plan.fits and plan.host_fits
    assert plan.phases[plan.peak_phase].get("parameters", 0) == 0  # on the host
    assert plan.host_total == pytest.approx(16 * LLAMA_70B.num_params() / 16, rel=1e-3)
    # Without the offload the sharded states alone (18 × 70.6B / 16 = 74 GiB) do not fit.
    assert not plan_memory(offload.replace(cpu_offload=False), H100).fits
    # LoRA rank 16 on q, k, v, 1×8 H100: fits with checkpointing; without it only because the
    # frozen base is stored in bf16 (70.6B × 2 / 8 = 16.4 GiB per GPU instead of 32.9).
    lora = Setup(
        args=LLAMA_70B,
        method="lora",
        lora_rank=16,
        lora_targets=("q", "k", "v"),
        gpus=8,
        activation_checkpointing="full",
    )
    assert plan_memory(lora, H100).fits
    no_ac = lora.replace(activation_checkpointing="none")
    assert plan_memory(no_ac, H100).fits
    assert not plan_memory(no_ac.replace(lora_base_dtype="fp32"), H100).fits
    fp32_base = plan_memory(no_ac.replace(lora_base_dtype="fp32"))
    saved = fp32_base.largest("parameters") - plan_memory(no_ac).largest("parameters")
    assert saved == pytest.approx(2 * (LLAMA_70B.num_params() - 128256 * 8192) / 8, rel=0.001)


def test_parse_memory():
    assert parse_memory("80GB") == 80 * GiB == parse_memory("80gib") == parse_memory("80")
    assert parse_memory("85e9") == 85 * 10**9
    assert parse_memory("h200") == 143771 * 2**20
    with pytest.raises(ConfigError, match="expected a size"):
        parse_memory("lots")


def test_full_init_threshold_matches_the_trainer():
    from lmforge.train.stage import FULL_INIT_MAX_PARAMS

    assert plan_memory_module.FULL_INIT_MAX_PARAMS == FULL_INIT_MAX_PARAMS


# ---- activations: the arithmetic against autograd's saved tensors ---------------------------


def _saved(root, params: set[int]) -> tuple[int, int]:
    """(activation bytes, weight-copy bytes) that autograd holds for backward: every saved
    tensor reachable from `root`, once per storage, parameters excluded; the second operand of
    a matmul is a (bf16) weight copy."""
    activations, copies, seen, stack, visited = {}, {}, set(), [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            value = getattr(node, name)
            for tensor in value if isinstance(value, (tuple, list)) else [value]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key in params or key in seen:
                    continue
                seen.add(key)
                is_copy = name == "_saved_mat2" and type(node).__name__ in (
                    "MmBackward0",
                    "GroupedMmBackward0",  # (a MoE's experts cast under autocast)
                )
                (copies if is_copy else activations)[key] = storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(activations.values()), sum(copies.values())


def _forward_saved(args, *, dtype, autocast, lora_targets=None, batch=2, seq=24):
    from lmforge.api import build_model

    torch.manual_seed(0)
    model = build_model(args)
    if lora_targets:
        apply_lora(model, targets=list(lora_targets), rank=4, alpha=8.0)
    model = model.to(dtype)
    for module in model.modules():  # a MoE's experts as on GPUs (models/moe.py)
        if hasattr(module, "grouped"):
            module.grouped = True
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens)
    return _saved(logits.grad_fn, params)


PATHS = {  # (model dtype, autocast, Setup precision)
    "fp32": (torch.float32, False, dict(param_dtype="fp32", compute_dtype="fp32")),
    "bf16 (as under FSDP mixed precision)": (
        torch.bfloat16,
        False,
        dict(param_dtype="bf16", compute_dtype="bf16"),
    ),
    "autocast": (
        torch.float32,
        True,
        dict(param_dtype="fp32", compute_dtype="bf16", bf16_params=False),
    ),
    "bf16 weights, fp32 masters (one GPU)": (
        torch.bfloat16,
        True,  # the trainer keeps autocast on (for DPO's fp32 frozen reference)
        dict(param_dtype="fp32", compute_dtype="bf16"),
    ),
}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_full_training_activations_equal_autograds_saved_tensors(path, family):
    dtype, autocast, precision = PATHS[path]
    args = tiny_args(family)
    batch, seq = 2, 24
    setup = Setup(args=args, method="full", micro_batch_size=batch, seq_len=seq, **precision)
    activations, copies = _forward_saved(args, dtype=dtype, autocast=autocast)
    per_layer = sum(layer_activations(setup).values())
    # head_activations counts the batch itself (16 bytes/token), which autograd does not hold.
    expected = batch * seq * (args.num_layers * per_layer + head_activations(setup) - 16)
    expected += 2 * seq * args.head_dim * setup.residual_bytes  # RoPE's cos and sin
    assert activations == expected
    assert plan_memory(setup).largest("activations") == expected + 16 * batch * seq
    # autocast's cached bf16 copy of every fp32 matmul weight (none of bf16 weights)
    norms = args.num_layers * args.layer_norm_params() + args.dim
    matmul = args.num_params(include_embedding=False) - norms
    assert copies == (2 * matmul if setup.autocast else 0)


@pytest.mark.parametrize("path", ["bf16 (as under FSDP mixed precision)", "autocast"])
def tiny_moe_args(**changes):
    shape = dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24, ffn_dim=160)
    moe = dict(vocab_size=250, num_experts=6, num_experts_per_tok=2, moe_ffn_dim=40)
    return get_preset("qwen3-30b-a3b").replace(**(shape | moe | changes))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize(
    ("path", "targets"),
    [(path, None) for path in sorted(PATHS)]
    + [
        (path, targets)  # LoRA's precisions (one GPU: autocast)
        for path in ("bf16 (as under FSDP mixed precision)", "autocast")
        for targets in (("q", "v"), ("q", "experts", "router"))
    ],
    ids=str,
)
def test_moe_block_activations_equal_autograds_saved_tensors(path, targets, norm_topk_prob):
    """A sparse block (the grouped path) fully trained, with LoRA beside frozen experts, and
    with LoRA on the experts and router: one block more (3 against 2) saves what the planner
    counts, but for the loss step's aux loss (outside the blocks' graph) and the products'
    [E] int32 offsets (a few bytes a layer) and LoRA's 8-byte scales: under 2 bytes a token."""
    dtype, autocast, precision = PATHS[path]
    batch, seq = 2, 24
    saved = {
        layers: _forward_saved(
            tiny_moe_args(num_layers=layers, norm_topk_prob=norm_topk_prob),
            dtype=dtype,
            autocast=autocast,
            lora_targets=targets,
        )[0]
        for layers in (2, 3)
    }
    setup = Setup(
        args=tiny_moe_args(norm_topk_prob=norm_topk_prob),
        method="lora" if targets else "full",
        lora_rank=4,
        lora_targets=targets or ("q",),  # (full training: none)
        micro_batch_size=batch,
        seq_len=seq,
        **precision,
    )
    parts = layer_activations(setup)
    per_layer = (saved[3] - saved[2]) / (batch * seq)
    assert per_layer == pytest.approx(sum(parts.values()) - parts["aux loss"], abs=2)


@pytest.mark.parametrize("path", ["bf16 (as under FSDP mixed precision)", "autocast"])
def test_lora_activations_equal_autograds_saved_tensors(path):
    dtype, autocast, precision = PATHS[path]
    targets = ("q", "v", "o", "down")
    batch, seq = 2, 24
    saved = {
        layers: _forward_saved(
            tiny_args(num_layers=layers), dtype=dtype, autocast=autocast, lora_targets=targets
        )
        for layers in (2, 3)
    }
    setup = Setup(
        args=tiny_args(),
        method="lora",
        lora_rank=4,
        lora_targets=targets,
        micro_batch_size=batch,
        seq_len=seq,
        **precision,
    )
    # One more block (the first block differs: nothing before it requires grad).
    # (within a byte per token: each adapter's scale is saved as an 8-byte scalar)
    per_layer = (saved[3][0] - saved[2][0]) / (batch * seq)
    assert per_layer == pytest.approx(sum(layer_activations(setup).values()), abs=1)
    if autocast:  # frozen weights cast at each use and saved; adapters cached
        args = tiny_args()
        kvd = args.num_kv_heads * args.head_dim
        block_linears = 2 * args.dim * args.dim + 2 * args.dim * kvd + 3 * args.dim * args.ffn_dim
        adapters = 4 * ((args.dim + args.dim) * 2 + (args.dim + kvd) + (args.ffn_dim + args.dim))
        assert saved[3][1] - saved[2][1] == 2 * (block_linears + adapters)


def test_checkpointing_and_tensor_parallel_shrink_activations():
    base = Setup(args=get_preset("llama3.1-8b"), micro_batch_size=2, seq_len=4096, gpus=8)
    acts = {
        mode: plan_memory(base.replace(activation_checkpointing=mode)).largest("activations")
        for mode in ("none", "selective", "full")
    }
    assert acts["none"] > 3 * acts["selective"] > 3 * acts["full"]
    # Sequence parallel splits the norms, heads and MLP columns, not the all-gathered inputs.
    with_tp = plan_memory(base.replace(tp=2)).largest("activations")
    assert acts["none"] / 2 < with_tp < acts["none"]
    # DPO runs chosen and rejected: twice the sequences, and the reference's logits on top.
    dpo = plan_memory(base.replace(method="dpo-full"))
    assert dpo.largest("activations") == pytest.approx(2 * acts["none"], rel=0.01)
    assert dpo.largest("reference model") == plan_memory(base).largest("parameters")


def test_more_gpus_less_state_and_offload_moves_it_to_the_host():
    base = Setup(args=get_preset("llama3.1-8b"), gpus=8, activation_checkpointing="full")
    eight, sixteen = plan_memory(base), plan_memory(base.replace(gpus=16))
    assert sixteen.largest("optimizer states") == pytest.approx(
        eight.largest("optimizer states") / 2, rel=0.01
    )
    offload = plan_memory(base.replace(cpu_offload=True))
    for name in ("parameters", "gradients", "optimizer states"):
        assert offload.largest(name) == 0 and offload.host[name] == eight.largest(name)


def test_gradient_accumulation_under_fsdp_holds_only_sharded_gradients():
    # The loop reduce-scatters after every micro-batch: the earlier micro-batches' gradients
    # wait sharded (1/8 per GPU), never as an unsharded fp32 copy of the whole model.
    base = Setup(args=get_preset("llama3.1-8b"), gpus=8, activation_checkpointing="full")
    one, four = plan_memory(base), plan_memory(base.replace(grad_accumulation=4))
    sharded_grads = 4 * get_preset("llama3.1-8b").num_params() / 8
    assert one.phases["forward end (loss)"].get("gradients", 0) == 0
    assert four.phases["forward end (loss)"]["gradients"] == pytest.approx(sharded_grads, rel=0.01)
    assert four.largest("gradient buffers") == one.largest("gradient buffers")
    assert 0 <= four.total - one.total <= sharded_grads * 1.01


def test_bf16_reduce_scatters_halve_the_reduce_buffers():
    """parallel.reduce_dtype = "bfloat16": FSDP2 reduce-scatters bf16 gradients, so the
    reduce-scatter inputs the planner counts take half the bytes; nothing else changes."""
    from lmforge.train.config import PretrainJob

    jobs = [
        PretrainJob.model_validate(
            {"model": {"source": "llama3.2-1b"}, "parallel": {"reduce_dtype": dtype}}
        )
        for dtype in ("float32", "bfloat16")
    ]
    fp32, bf16 = (plan_memory_module.setup_from_job(job, gpus=2) for job in jobs)
    assert (fp32.reduce_bytes, bf16.reduce_bytes) == (4, 2)
    assert plan_memory(bf16).largest("gradient buffers") < plan_memory(fp32).largest(
        "gradient buffers"
    )
    assert plan_memory(bf16).largest("parameters") == plan_memory(fp32).largest("parameters")


def test_qlora_stores_adapted_bases_as_nf4():
    pytest.importorskip("torchao")
    from lmforge.modules.lora import _to_nf4
    from lmforge.sizes import tensor_bytes

    for shape in ((64, 64), (512, 1024)):
        for dtype in (torch.float32, torch.bfloat16):
            nf4 = _to_nf4(torch.randn(shape, dtype=dtype), 64)
            planned = plan_memory_module.nf4_bytes(math.prod(shape), dtype.itemsize)
            assert tensor_bytes(nf4) == planned
    args = get_preset("llama3.1-8b")
    qlora = plan_memory(Setup(args=args, method="qlora", activation_checkpointing="full"))
    lora = plan_memory(Setup(args=args, method="lora", activation_checkpointing="full"))
    # The seven linears of every block drop from 2 bytes (bf16) to ~0.52; the output
    # projection stays bf16, embeddings and norms fp32.
    linears = args.num_params() - 2 * args.vocab_size * args.dim
    saved = lora.largest("parameters") - qlora.largest("parameters")
    assert saved == pytest.approx(linears * (2 - 0.516), rel=0.01)


def test_trainer_rules_are_enforced():
    args = get_preset("llama3.2-1b")  # tied embeddings
    with pytest.raises(ConfigError, match=r"lora\.enabled with parallel\.tp"):
        plan_memory(Setup(args=args, method="lora", gpus=2, tp=2))
    with pytest.raises(ConfigError, match="QLoRA"):
        plan_memory(Setup(args=args, method="qlora", gpus=2, cpu_offload=True))
    with pytest.raises(ConfigError, match="does not match the world size"):
        plan_memory(Setup(args=args, gpus=8, dp_shard=3))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        plan_memory(Setup(args=get_preset("llama3.1-8b"), gpus=6, tp=3))


# ---- the dry run: real parallelize() on a fake process group --------------------------------

DRY_RUNS = {
    "1 rank": dict(gpus=1),
    "1 rank, DPO full (bf16 weights and reference)": dict(gpus=1, method="dpo-full"),
    "1 rank, CPU offload (FSDP)": dict(gpus=1, cpu_offload=True),
    "FSDP 2": dict(gpus=2, activation_checkpointing="selective"),
    "TP 2 (no FSDP)": dict(gpus=2, tp=2),
    "FSDP 4 × TP 2": dict(gpus=8, tp=2),
    "HSDP 2 × 4, LoRA": dict(
        gpus=8, dp_replicate=2, method="lora", lora_rank=3, lora_targets=("q", "v", "output")
    ),
    "FSDP 8, DPO full (frozen copy)": dict(gpus=8, method="dpo-full"),
    "QLoRA": dict(gpus=1, method="qlora", lora_targets=("q", "k", "v", "down")),
    "QLoRA, FSDP 2": dict(gpus=2, method="qlora", lora_targets=("q", "k", "v", "down")),
    "tied, FSDP 2": dict(gpus=2, tied=True),
    "tied, FSDP 4 × TP 2": dict(gpus=8, tp=2, tied=True),
    "tied, HSDP 2 × 2, DPO full": dict(gpus=4, dp_replicate=2, method="dpo-full", tied=True),
    "qwen3, tied, FSDP 4 × TP 2": dict(gpus=8, tp=2, tied=True, family="qwen3"),
    "qwen3, HSDP 2 × 4, LoRA": dict(
        gpus=8, dp_replicate=2, method="lora", lora_targets=("q", "k", "down"), family="qwen3"
    ),
}


@pytest.mark.parametrize("name", sorted(DRY_RUNS))
def test_dry_run_shards_equal_the_arithmetic(name):
    layout = dict(DRY_RUNS[name])
    if layout.get("method") == "qlora":
        pytest.importorskip("torchao")
    args = tiny_args(layout.pop("family", "llama")).replace(
        tie_embeddings=layout.pop("tied", False)
    )
    setup = Setup(args=args, **layout)
    report = dry_run(setup)
    assert report.mismatches == []
    assert report.measured == report.arithmetic
    plan = plan_memory(setup)
    trainable = report.measured["parameters (trainable)"]
    assert report.measured["gradients"] == trainable  # in the parameters' dtype
    # AdamW: two fp32 states; with bf16 weights (one GPU) also their fp32 masters: 12 = 6 × 2
    states = 6 if setup.master_weights else 2
    assert report.measured["optimizer states"] == states * trainable
    if not setup.cpu_offload:
        on_gpu = report.measured["parameters (trainable)"] + report.measured["parameters (frozen)"]
        assert plan.largest("parameters") == on_gpu
    assert "equal the arithmetic" in report.table()


def test_dry_run_llama_8b_fsdp_tp_padding():
    setup = Setup(args=get_preset("llama3.1-8b"), gpus=24, tp=8)  # vocab 128256 / 8 / 3
    report = dry_run(setup)
    assert report.matches
    assert report.tensors["tok_embeddings.weight"].local_shape == (math.ceil(128256 / 8 / 3), 4096)


# ---- search and suggestions -----------------------------------------------------------------


def test_search_finds_the_fewest_gpus():
    from lmforge.plan.search import _layouts, gpu_counts

    base = Setup(args=get_preset("llama3.1-8b"), micro_batch_size=2, seq_len=4096)
    result = search(base, H100)
    assert result.plan is not None and result.plan.fits and result.plan.setup.gpus == result.gpus
    for gpus in [n for n in gpu_counts(8) if n < result.gpus]:  # no layout fits on fewer
        assert not any(plan_memory(c, H100).fits for c in _layouts(base, gpus, set()))
    # Fixed choices stay fixed.
    fixed = search(base.replace(activation_checkpointing="none"), H100, fixed={"ac"})
    assert fixed.plan.setup.activation_checkpointing == "none"
    assert fixed.gpus >= result.gpus


def test_suggestions_fit_and_are_ranked_by_cost():
    setup = Setup(args=get_preset("llama3.1-8b"), gpus=1, micro_batch_size=4, seq_len=4096)
    plan = plan_memory(setup, H100)
    assert not plan.fits
    items = suggest(plan)
    assert items and all(item.plan.fits for item in items)
    assert [item.cost for item in items] == sorted(item.cost for item in items)
    assert any(item.change.startswith("--gpus") for item in items)


# ---- jobs and the CLI ---------------------------------------------------------------------


def test_plan_job_reads_pretrain_sft_dpo_jobs():
    from lmforge.train.config import DPOJob, PretrainJob, SFTJob

    pretrain = PretrainJob.model_validate({"model": {"source": "llama3.2-1b"}})
    plan = plan_job(pretrain, gpus=1, gpu_memory="h100")
    assert plan.setup.method == "pretrain" and plan.setup.micro_batch_size == 8
    assert plan.fits  # 8 × 2048 without checkpointing: the fused loss keeps one bf16 logits
    larger = PretrainJob.model_validate({"model": {"source": "llama3.2-3b"}})
    plan = plan_job(larger, gpus=1, gpu_memory="h100")
    assert not plan.fits and plan.suggestions  # the 3B's 8 × 2048 without checkpointing
    sft = SFTJob.model_validate(
        {"model": {"source": "llama3.1-8b"}, "lora": {"enabled": True, "rank": 16}}
    )
    assert plan_job(sft, gpus=2, gpu_memory="80GB").setup.method == "lora"
    dpo = DPOJob.model_validate({"model": {"source": "llama3.1-8b"}})
    assert plan_job(dpo, gpus=8, gpu_memory="80GB").setup.reference == "frozen_copy"


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_seed_full_finetune_with_offload(capsys):
    argv = "--model llama3.1-70b --method full --gpus 2x8 --gpu-memory h100 --ac full"
    code, out, _ = _cli(capsys, *argv.split(), "--cpu-offload")
    assert code == 0
    assert "18 bytes/parameter (parameters 6, gradients 4, optimizer states 8)" in out
    assert "16 GPUs (2 nodes × 8)" in out and "FITS" in out
    assert "host memory (CPU offload, pinned)" in out


def test_cli_host_memory_while_loading_follows_the_method(capsys):
    """Finetuning a preset's shape loads its checkpoint as stored (bf16: 2 bytes a parameter
    on rank 0); pretraining it starts from a fresh fp32 model, initialized on rank 0 up to
    20B parameters and shard by shard past that (nothing held)."""
    from lmforge.models import get_preset

    gib = 2**30
    for model, method, per_param in (
        ("qwen3-235b-a22b", "lora", 2),
        ("llama3.1-8b", "full", 2),
        ("llama3.1-8b", "pretrain", 4),
    ):
        code, out, _ = _cli(capsys, "--model", model, "--method", method, "--gpus", "2x8")
        assert code in (0, 1)  # (fits or not: the plan is printed either way)
        want = get_preset(model).num_params() * per_param / gib
        assert f"rank 0 holds the full starting weights, {want:.1f} GiB" in out, (model, method)
    _, out, _ = _cli(capsys, "--model", "llama3.1-70b", "--method", "pretrain", "--gpus", "2x8")
    assert "while loading" not in out


def test_cli_does_not_fit_prints_suggestions(capsys):
    code, out, _ = _cli(capsys, "--model", "llama3.1-70b", "--gpus", "16", "--gpu-memory", "80GB")
    assert code == 1
    assert "DOES NOT FIT" in out and "suggestions, cheapest first" in out


def test_cli_search_and_bad_arguments(capsys):
    argv = "--model llama3.1-8b --gpu-memory 80GB --micro-batch-size 4 --search"
    code, out, _ = _cli(capsys, *argv.split())
    assert "search: fewest GPUs of 80 GiB that fit:" in out
    code, _, err = _cli(capsys, "--model", "llama3.1-8b", "--gpus", "3x")
    assert code == 2 and "NODESxGPUS" in err
    code, _, err = _cli(capsys, "--model", "llama3.1-8b", "--gpus", "6", "--tp", "4")
    assert code == 2 and "world size" in err


def test_cli_job_config_with_dry_run(tmp_path, capsys):
    config = tmp_path / "sft.toml"
    config.write_text(
        '[model]\nsource = "tiny"\n[lora]\nenabled = true\nrank = 4\n'
        "[train]\nmicro_batch_size = 2\n[data]\nmax_seq_len = 128\n"
    )
    code, out, _ = _cli(
        capsys, "--config", str(config), "--gpus", "2", "--gpu-memory", "h100", "--dry-run"
    )
    assert code == 0
    assert "LoRA rank 4" in out and "micro-batch 2 × 128 tokens" in out
    assert "dry run: parallelize() on the meta device over a fake process group of 2 ranks" in out
    assert "equal the arithmetic" in out


def test_cli_plans_an_inference_stage(capsys):
    """`--task` prints the inference planner's table: its numbers are plan_inference's, and a
    stage that does not fit gets suggestions that do (exit 1), one that fits exit 0."""
    from lmforge.plan.inference import InferenceSetup, plan_inference

    argv = "--model llama3.1-70b --task generate --tp 2 --batch 16 --seq-len 8192 --gpu-memory h100"
    code, out, _ = _cli(capsys, *argv.split())
    setup = InferenceSetup(args=get_preset("llama3.1-70b"), tp=2, batch=16, seq_len=8192)
    expected = plan_inference(setup, "h100")
    assert code == 1 and not expected.fits
    assert "70.6B in bf16 on 2 GPUs (tensor parallel); KV cache 16 × 8192 tokens" in out
    assert f"DOES NOT FIT: {expected.total / GiB:.1f} of" in out
    assert "suggestion: tensor parallelism over 4 GPUs" in out
    assert "lmforge launch --nproc 4 generate" in out
    code, out, _ = _cli(capsys, *argv.replace("--tp 2", "--tp 4").split())
    assert code == 0 and "fits: " in out and "suggestion" not in out
    code, out, _ = _cli(
        capsys, "--model", "llama3.1-8b", "--task", "eval", "--quantization", "int4-wo"
    )
    assert code == 0 and "8.0B in int4-wo on one GPU; scoring 8 × 4096 tokens (256 through" in out
    # the defaults are those of lmforge eval and of the pipeline's eval stage
    eval_setup = InferenceSetup(
        args=get_preset("llama3.1-8b"),
        task="eval",
        quantization="int4-wo",
        batch=8,
        seq_len=4096,
        scored_tokens=256,
    )
    assert f"fits: {plan_inference(eval_setup, '80GB').total / GiB:.1f} of" in out


def test_cli_inference_and_training_flags_do_not_mix(capsys):
    code, _, err = _cli(capsys, "--model", "llama3.1-8b", "--task", "eval", "--method", "lora")
    assert code == 2 and "--method: only without --task" in err
    code, _, err = _cli(capsys, "--model", "llama3.1-8b", "--task", "generate", "--gpus", "8")
    assert code == 2 and "--gpus: only without --task" in err and "its --tp" in err
    code, _, err = _cli(capsys, "--model", "llama3.1-8b", "--task", "generate", "--tp", "0")
    assert code == 2 and "tp, batch, seq_len and prefill_chunk must be >= 1" in err
    code, _, err = _cli(capsys, "--model", "llama3.1-8b", "--task", "score", "--scored-tokens", "0")
    assert code == 2 and "scored_tokens 0 must be >= 1" in err
    code, _, err = _cli(capsys, "--model", "llama3.1-8b", "--batch", "4")
    assert code == 2 and "--batch: only with --task" in err
    code, _, err = _cli(capsys, "--model", "llama3.1-8b", "--task", "serve")
    assert code == 2 and "task 'serve'; allowed: generate, score, eval, quantize" in err


def test_building_the_command_line_does_not_import_torch():
    """`lmforge --help` (and every command's start) builds all parsers: registering `plan`
    must stay torch-free (importing the inference planner for its choices made it 7× slower)."""
    code = "import sys; from lmforge.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
