"""Training's Triton kernels (the fused output projection + cross entropy, the AdamW update),
on the CPU under Triton's interpreter: against PyTorch's own linear, cross entropy and AdamW;
and compiled, without a GPU, for an H100/H200."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.sft import IGNORE_INDEX
from lmforge.models.llama import Transformer, get_preset
from lmforge.modules import cross_entropy
from lmforge.train.adamw import AdamW
from lmforge.train.loop import skips_diverged_step_on_device
from lmforge.train.losses import CausalLMLoss

# The suite runs the kernels on the CPU under Triton's interpreter; with TRITON_INTERPRET=0 on a
# GPU machine the same tests run them compiled.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(), reason="Triton's interpreter or a GPU"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_cross_entropy_equals_linear_and_cross_entropy(monkeypatch, dtype):
    """Loss and both gradients equal F.linear + F.cross_entropy (summed, IGNORE_INDEX rows
    left out, a vocab over several row blocks and not a multiple of one), under a scale the
    backward brings; without grad mode the loss alone."""
    monkeypatch.setattr(cross_entropy, "ROW_BLOCK", 128)
    torch.manual_seed(0)
    rows, dim, vocab = 12, 32, 300
    output = nn.Linear(dim, vocab, bias=False, dtype=dtype, device=DEVICE)
    hidden = torch.randn(2, rows // 2, dim, dtype=dtype, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, vocab, (2, rows // 2), device=DEVICE)
    labels[0, 2] = labels[1, 5] = IGNORE_INDEX
    loss = cross_entropy.output_cross_entropy(hidden, output, labels, kernel=True)
    (loss * 0.37).backward()
    grads = hidden.grad, output.weight.grad
    hidden.grad = output.weight.grad = None
    logits = output(hidden).flatten(0, 1).float()
    reference = F.cross_entropy(
        logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    (reference * 0.37).backward()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference.detach(), **tolerance)
    torch.testing.assert_close(grads[0], hidden.grad, **tolerance)
    torch.testing.assert_close(grads[1], output.weight.grad, **tolerance)
    with torch.no_grad():
        again = cross_entropy.output_cross_entropy(hidden, output, labels, kernel=True)
    torch.testing.assert_close(again, loss.detach())


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_fused_loss_step_equals_logits_then_cross_entropy(monkeypatch, tied):
    """The model's labels= path (the kernel, as on a GPU) against logits + the loss apart:
    the same loss and gradients, a tied output projection (the embedding's table gets both
    uses' gradients) and an untied one."""
    monkeypatch.setattr(cross_entropy, "ROW_BLOCK", 128)
    monkeypatch.setattr(cross_entropy, "fusable", lambda hidden, output: True)
    args = get_preset("tiny").replace(tie_embeddings=tied)
    torch.manual_seed(0)
    model = Transformer(args).to(DEVICE)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 9), device=DEVICE)
    labels = torch.randint(0, args.vocab_size, (2, 9), device=DEVICE)
    labels[:, :3] = IGNORE_INDEX
    batch = {"inputs": tokens, "labels": labels}
    results = []
    for fused in (True, False):
        model.zero_grad()
        out = CausalLMLoss(fused=fused)(model, batch)
        (out.loss_sum / out.num_tokens).backward()
        results.append((out.loss_sum.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_loss_is_fused_on_gpus_without_tensor_parallelism():
    class Layout:
        def __init__(self, device, tp_size):
            self.device, self.tp_size = torch.device(device), tp_size

    assert CausalLMLoss.for_layout(Layout("cuda", 1), compile=False).fused
    assert not CausalLMLoss.for_layout(Layout("cuda", 2), compile=False).fused
    assert not CausalLMLoss.for_layout(Layout("cpu", 1), compile=False).fused
    plain = nn.Linear(4, 8, bias=False)
    assert cross_entropy.fusable_output(plain)
    assert not cross_entropy.fusable(torch.zeros(2, 4), plain)  # the CPU
    assert not cross_entropy.fusable_output(nn.Linear(4, 8))  # a bias
    assert not cross_entropy.fusable_output(nn.Identity())  # not a linear (e.g. NF4Linear)


def _groups(params):
    return [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "weight_decay": 0.0},
    ]


def test_the_adamw_kernel_equals_torch_adamw():
    """Four steps against torch.optim.AdamW: gradients divided by `grad_scale` (clipping), a
    step with `found_inf` = 1 skipped whole (its step count too), weight decay by group; the
    state dict loads into torch's AdamW, and the trainer launches it before its host sync."""
    torch.manual_seed(0)
    shapes = [(33, 70), (5000,), (7,)]
    ours = [torch.randn(shape, device=DEVICE, requires_grad=True) for shape in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    optimizer = AdamW(_groups(ours), **options)
    reference = torch.optim.AdamW(_groups(theirs), foreach=False, **options)
    assert optimizer.kernel and skips_diverged_step_on_device(optimizer, torch.device(DEVICE))
    for step in range(4):
        grads = [torch.randn(shape, device=DEVICE) for shape in shapes]
        for param, grad in zip(ours, grads):
            param.grad = grad.clone()
        optimizer.grad_scale = torch.tensor(2.5, device=DEVICE)
        optimizer.found_inf = torch.tensor(float(step == 2), device=DEVICE)
        optimizer.step()
        del optimizer.grad_scale, optimizer.found_inf
        if step != 2:
            for param, grad in zip(theirs, grads):
                param.grad = grad / 2.5
            reference.step()
    for mine, theirs_ in zip(ours, theirs):
        torch.testing.assert_close(mine, theirs_, rtol=1e-5, atol=1e-6)
    assert optimizer.state[ours[0]]["step"].item() == 3
    state = optimizer.state_dict()
    loaded = torch.optim.AdamW(_groups(theirs), **options)
    loaded.load_state_dict(state)
    torch.testing.assert_close(
        loaded.state[theirs[0]]["exp_avg"], optimizer.state[ours[0]]["exp_avg"]
    )
    assert not AdamW(_groups(theirs), kernel=False, **options).kernel


def test_bf16_parameters_are_updated_through_fp32_masters():
    """bf16_params: the parameters become bf16, the optimizer keeps their fp32 values; three
    steps on bf16 gradients equal torch's AdamW on fp32 parameters with the same gradients,
    each parameter the bf16 rounding of its master. State dicts and loading see the masters
    (fp32), and loaded moments stay fp32."""
    torch.manual_seed(0)
    shapes = [(33, 70), (5000,), (7,)]
    ours = [nn.Parameter(torch.randn(shape, device=DEVICE)) for shape in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    options = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    optimizer = AdamW(_groups(ours), bf16_params=True, **options)
    reference = torch.optim.AdamW(_groups(theirs), foreach=False, **options)
    assert all(p.dtype == torch.bfloat16 for p in ours) and len(optimizer.masters) == 3
    for _ in range(3):
        for param, other in zip(ours, theirs):
            param.grad = torch.randn(param.shape, device=DEVICE, dtype=torch.bfloat16)
            other.grad = param.grad.float()
        optimizer.step()
        reference.step()
    for param, other in zip(ours, theirs):
        master = optimizer.masters[param]
        torch.testing.assert_close(master, other.detach(), rtol=1e-5, atol=1e-6)
        if INTERPRETED:  # the interpreter's fp32 -> bf16 truncates; a GPU rounds to nearest
            torch.testing.assert_close(param.detach().float(), master, rtol=2**-7, atol=0)
        else:
            assert torch.equal(param.detach(), master.bfloat16())
    with optimizer.masters_in_params():
        assert ours[0].dtype == torch.float32
        assert torch.equal(ours[0].detach(), optimizer.masters[ours[0]])
        ours[0].data.fill_(0.25)  # what a load does
    assert ours[0].dtype == torch.bfloat16 and torch.all(ours[0] == 0.25)
    assert torch.all(optimizer.masters[ours[0]] == 0.25)
    fresh = AdamW(_groups([nn.Parameter(p.detach().float()) for p in ours]), bf16_params=True)
    fresh.load_state_dict(optimizer.state_dict())
    moments = [state["exp_avg_sq"] for state in fresh.state.values()]
    assert len(moments) == 3 and all(m.dtype == torch.float32 for m in moments)
    plain = AdamW(_groups([nn.Parameter(torch.ones(3, device=DEVICE))]), kernel=False)
    assert not plain.masters  # the masters go with the kernel only


def test_bf16_params_resume_exactly_and_export_their_masters(tmp_path, monkeypatch):
    """Pretraining with optim.bf16_params through the real stage (its CUDA-only conditions
    waived, the kernel under the interpreter), two micro-batches a step: stopped at step 2 and
    resumed, the losses equal
    those of the run that went on (the checkpoint holds the fp32 masters and moments, not the
    bf16 weights), close to fp32 weights under autocast; the fp32 export holds the masters."""
    import lmforge
    from tests.train_utils import losses, make_shards, pretrain_args, run_inprocess

    made = _waive_cuda_for_bf16_params(monkeypatch)
    tokenizer, shards = make_shards(tmp_path / "data")

    def run(name, steps, *extra):  # two micro-batches of 4 a step
        args = pretrain_args(tmp_path / name, tokenizer, shards, *extra)
        args += [f"train.steps={steps}", "checkpoint.every=2", "train.mixed_precision=bf16"]
        args += ["train.global_batch_size=8"]
        args += ["checkpoint.export_dtype=float32"]
        assert run_inprocess("pretrain", args) == 0
        return losses(tmp_path / name)

    whole = run("whole", 4, "optim.bf16_params=true")
    run("resumed", 2, "optim.bf16_params=true")
    resumed = run("resumed", 4, "optim.bf16_params=true")
    fp32 = run("fp32", 4, "optim.bf16_params=false")
    assert made == [True, True, True, False]
    assert resumed == whole and len(whole) == 4
    for step in (1, 2, 3):  # (step 4 is a spike at the peak lr of 1e-2, where the two part)
        assert abs(fp32[step] - whole[step]) < 0.01, (step, fp32[step], whole[step])
    norms = torch.tensor([record["grad_norm"] for record in _records(tmp_path / "whole")])
    assert not torch.equal(norms, norms.bfloat16().double())  # summed in fp32, not bf16
    weights = lmforge.load(tmp_path / "whole" / "artifact", dtype=torch.float32).model
    table = weights.tok_embeddings.weight
    assert not torch.equal(table, table.bfloat16().float())  # fp32 values, not bf16 weights


def _waive_cuda_for_bf16_params(monkeypatch) -> list[bool]:
    """The stage takes optim.bf16_params as given, with lmforge's AdamW (the interpreter runs
    its kernel) on the CPU; returns the list of the bf16_params each optimizer was built with."""
    from lmforge.train import stage

    made = []

    def build(model, cfg, device, *, bf16_params):
        made.append(bf16_params)
        options = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        params = [p for p in model.parameters() if p.requires_grad]
        return AdamW(params, bf16_params=bf16_params, **options)

    monkeypatch.setattr(stage, "build_optimizer", build)
    monkeypatch.setattr(stage, "keeps_bf16_params", lambda job, *_: bool(job.optim.bf16_params))
    return made


def test_bf16_params_dpo_reference_equals_the_policy_at_the_start(tmp_path, monkeypatch):
    """Full DPO with bf16 weights (fp32 masters): the frozen reference is stored in bf16 too, so
    at the first step the policy and the reference score alike and the loss is log 2 (an fp32
    reference under autocast would not: its residual stream is fp32)."""
    import math

    from tests.test_post_training import _base, full_dpo_args
    from tests.train_utils import run_inprocess

    made = _waive_cuda_for_bf16_params(monkeypatch)
    base = _base(tmp_path, tied=True)
    extra = ["optim.bf16_params=true", "train.mixed_precision=bf16", "train.steps=1"]
    assert run_inprocess("dpo", full_dpo_args(tmp_path / "dpo", base, *extra)) == 0
    assert made == [True]
    assert _records(tmp_path / "dpo")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_micro_batch_gradients_of_bf16_weights_add_up_in_fp32():
    """`add_in_fp32`: three micro-batches' bf16 gradients end as their fp32 sum rounded once to
    bf16 (added up in bf16 they would differ), a parameter without a gradient in the last one
    included; none is left in the sums."""
    from lmforge.train.loop import add_in_fp32

    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(4000, dtype=torch.bfloat16)) for _ in range(2)]
    grads = [[torch.randn(4000).bfloat16() for _ in params] for _ in range(3)]
    sums: dict = {}
    for index, micro_batch in enumerate(grads):
        for param, grad in zip(params, micro_batch):
            param.grad = None if (index == 2 and param is params[1]) else grad.clone()
        add_in_fp32(params, sums, last=index == 2)
    assert not sums
    for which, param in enumerate(params):
        parts = [micro_batch[which] for micro_batch in grads[: 3 if which == 0 else 2]]
        assert torch.equal(param.grad, sum(g.float() for g in parts).bfloat16())
    in_bf16 = grads[0][0] + grads[1][0] + grads[2][0]
    assert not torch.equal(params[0].grad, in_bf16)


def _records(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_bf16_params_where_they_apply():
    """optim.bf16_params: None takes them on one CUDA device for full training (with gradient
    accumulation too); true where they cannot apply names what is missing (exit code 2)."""
    from lmforge.errors import ConfigError
    from lmforge.train.config import PretrainJob, SFTJob
    from lmforge.train.stage import keeps_bf16_params
    from tests.test_train_extras import _layout

    def job(**sections):
        base = {"data": {"shards": "x"}, "train": {"micro_batch_size": 8}}
        return PretrainJob.model_validate(base | sections)

    assert keeps_bf16_params(job(), _layout("cuda", 1), True)
    assert not keeps_bf16_params(job(), _layout("cuda", 1), False)
    assert not keeps_bf16_params(job(), _layout("cuda"), True)
    assert not keeps_bf16_params(SFTJob(lora={"enabled": True}), _layout("cuda", 1), True)
    accumulating = {"micro_batch_size": 2, "global_batch_size": 8}
    assert keeps_bf16_params(job(train=accumulating), _layout("cuda", 1), True)
    forced = {"bf16_params": True}
    assert keeps_bf16_params(job(optim=forced), _layout("cuda", 1), True)
    assert not keeps_bf16_params(job(optim={"bf16_params": False}), _layout("cuda", 1), True)
    with pytest.raises(ConfigError, match=r"needs a CUDA device; one process") as error:
        keeps_bf16_params(job(optim=forced), _layout("cpu"), True)
    assert error.value.exit_code == 2


COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lmforge.modules import cross_entropy
from lmforge.train import adamw

target = GPUTarget("cuda", 90, 32)
for write_grad in (True, False):
    signature = {"logits_ptr": "*bf16", "labels_ptr": "*i64", "losses_ptr": "*fp32",
                 "vocab": "i32", "stride": "i32", "ignore_index": "i32",
                 "WRITE_GRAD": "constexpr", "BLOCK": "constexpr"}
    constants = {"WRITE_GRAD": write_grad, "BLOCK": cross_entropy.ROW_BLOCK}
    source = ASTSource(cross_entropy._cross_entropy_rows, signature, constexprs=constants)
    triton.compile(source, target=target, options={"num_warps": 16})
for flags in ((True, True, True), (False, False, False)):
    signature = {name: "*fp32" for name in adamw._adamw_update.arg_names[:8]}
    if flags[2]:  # a bf16 parameter and gradient with an fp32 master
        signature |= {"param_ptr": "*bf16", "grad_ptr": "*bf16"}
    signature |= {"numel": "i64"} | {n: "fp32" for n in ("lr", "beta1", "beta2", "eps", "weight_decay")}
    signature |= {f: "constexpr" for f in ("HAS_SCALE", "HAS_INF", "HAS_MASTER", "BLOCK")}
    constants = {"HAS_SCALE": flags[0], "HAS_INF": flags[1], "HAS_MASTER": flags[2], "BLOCK": adamw.BLOCK}
    source = ASTSource(adamw._adamw_update, signature, constexprs=constants)
    triton.compile(source, target=target, options={"num_warps": 8})
print("compiled 4")
"""


def test_the_training_kernels_compile_for_a_gpu():
    """The interpreter runs code the GPU compiler refuses, so both kernels are also compiled,
    without a GPU, for sm_90 with the ptxas that Triton ships."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 4" in done.stdout


def test_the_adamw_kernel_takes_sharded_parameters_and_checkpoints(tmp_path):
    """DTensor parameters (as FSDP2 and tensor parallelism hand them over; here a one-process
    mesh) update through their local shards like plain ones, and the state goes through DCP's
    optimizer state dict and back (whose loading first steps a fresh optimizer at lr 0)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo" if DEVICE == "cpu" else "nccl", store=store, rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh(DEVICE, (1,))
        torch.manual_seed(0)
        plain = nn.Linear(40, 24, bias=False, device=DEVICE)
        sharded = nn.Linear(40, 24, bias=False, device=DEVICE)
        sharded.weight = nn.Parameter(distribute_tensor(plain.weight.detach(), mesh, [Shard(0)]))
        options = dict(lr=1e-2, weight_decay=0.1)
        optimizers = [AdamW(plain.parameters(), **options), AdamW(sharded.parameters(), **options)]
        assert all(optimizer.kernel for optimizer in optimizers)
        for _ in range(2):
            grad = torch.randn(24, 40, device=DEVICE)
            plain.weight.grad = grad
            sharded.weight.grad = distribute_tensor(grad, mesh, [Shard(0)])
            for optimizer in optimizers:
                optimizer.step()
        torch.testing.assert_close(sharded.weight.full_tensor(), plain.weight.detach())
        saved = get_optimizer_state_dict(sharded, optimizers[1])
        fresh = AdamW(sharded.parameters(), **options)
        set_optimizer_state_dict(sharded, fresh, saved)
        moments = fresh.state[sharded.weight]["exp_avg"]
        torch.testing.assert_close(
            moments.full_tensor(), optimizers[0].state[plain.weight]["exp_avg"]
        )
        assert fresh.state[sharded.weight]["step"].item() == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not INTERPRETED, reason="two gloo processes on the CPU")
def test_the_fused_loss_and_adamw_under_fsdp2_on_two_processes():
    """Under FSDP2 over two processes, with tied and with untied embeddings: the fused loss
    equals the logits apart (loss and every gradient), and the AdamW kernel's step over the
    sharded parameters equals torch's AdamW."""
    worker = Path(__file__).parent / "scripts" / "fused_loss_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", str(worker)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "fused loss ok" in done.stdout, (done.stdout + done.stderr)[-4000:]
