"""`lmforge plan --dry-run`: the real sharding plan, without GPUs.

Builds the model on the meta device (with LoRA swapped in when the method uses it), applies the
real `lmforge.train.parallelize.parallelize` over a fake process group of the planned world size
(torch.distributed's "fake" backend: collectives are no-ops, so nothing is allocated and nothing
communicates), and reads rank 0's shard of every parameter from its DTensor local shape.
Gradients have the same shapes in the gradient dtype; AdamW keeps two states of each trainable
parameter in its dtype. The same numbers from `memory.param_specs` / `local_shape` are compared
tensor by tensor.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lmforge.errors import UserError
from lmforge.plan.memory import (
    GiB,
    Setup,
    check_setup,
    local_shape,
    nf4_bytes,
    param_specs,
    parameter_bytes,
)

_WRAPPER_PREFIX = "_checkpoint_wrapped_module."
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TensorShard:
    name: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    placements: str = ""


@dataclass
class DryRun:
    """Rank 0's sharded sizes as parallelize() produced them, next to the arithmetic."""

    setup: Setup
    tensors: dict[str, TensorShard]  # the policy model's parameters
    reference_tensors: dict[str, TensorShard] = field(default_factory=dict)
    measured: dict[str, int] = field(default_factory=dict)  # bytes by component
    arithmetic: dict[str, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)  # tensors whose shard shapes differ
    notes: list[str] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return not self.mismatches and self.measured == self.arithmetic

    def table(self) -> str:
        s = self.setup
        replicate, shard, tp = s.mesh
        lines = [
            f"dry run: parallelize() on the meta device over a fake process group of "
            f"{s.gpus} rank{'s' if s.gpus > 1 else ''} (dp_replicate {replicate} × dp_shard "
            f"{shard} × tp {tp}); rank 0's shards",
            f"  {'':34s} {'dry run':>14s} {'arithmetic':>14s}",
        ]
        for key in self.measured:
            got, want = self.measured[key], self.arithmetic.get(key, 0)
            mark = "" if got == want else "   MISMATCH"
            lines.append(f"  {key:34s} {got / GiB:10.4f} GiB {want / GiB:10.4f} GiB{mark}")
        count = len(self.tensors) + len(self.reference_tensors)
        if self.mismatches:
            lines.append(f"  {len(self.mismatches)} of {count} tensors differ, e.g.:")
            lines += [f"    {m}" for m in self.mismatches[:5]]
        else:
            lines.append(f"  all {count} tensors' shard shapes equal the arithmetic")
        largest = sorted(
            self.tensors.values(), key=lambda t: math.prod(t.local_shape), reverse=True
        )[:3]
        for t in largest:
            lines.append(
                f"  e.g. {t.name}: {list(t.shape)} -> {list(t.local_shape)} {t.placements}"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@contextmanager
def fake_process_group(world_size: int):
    """A process group of `world_size` ranks (this process is rank 0) whose collectives do
    nothing: enough for DeviceMesh, DTensor and fully_shard to lay out shards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError(
            "--dry-run starts its own fake process group; run it outside torchrun / an "
            "initialized process group"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build(setup: Setup, layout, parallel, *, lora: bool):
    from lmforge import models
    from lmforge.modules.lora import apply_lora
    from lmforge.train.parallelize import parallelize

    with torch.device("meta"), _default_dtype(_TORCH_DTYPES[setup.param_dtype]):
        model = models.new_model(setup.args)
    if lora:
        apply_lora(
            model,
            targets=list(setup.lora_targets),
            rank=setup.lora_rank,
            alpha=2.0 * setup.lora_rank,
            base_dtype=torch.bfloat16 if setup.frozen_linear_bytes == 2 else None,
        )
    parallelize(model, layout, parallel, bf16=setup.compute_dtype == "bf16")
    return model


def _shards(model) -> dict[str, TensorShard]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():  # shared (tied) parameters once
        name = name.replace(_WRAPPER_PREFIX, "")
        if isinstance(param, DTensor):
            local = tuple(param.to_local().shape)
            placements = "(" + ", ".join(str(p) for p in param.placements) + ")"
        else:
            local, placements = tuple(param.shape), ""
        out[name] = TensorShard(
            name=name,
            shape=tuple(param.shape),
            local_shape=local,
            dtype=param.dtype,
            trainable=param.requires_grad,
            placements=placements,
        )
    return out


def dry_run(setup: Setup) -> DryRun:
    """Apply the real parallelize() for `setup` on a fake process group and compare rank 0's
    parameter, gradient and optimizer-state bytes with the arithmetic."""
    from torch.distributed.device_mesh import init_device_mesh

    from lmforge.parallel.config import ParallelSection
    from lmforge.parallel.distributed import MESH_AXES, SPARSE_AXES, Layout
    from lmforge.train.optim import to_bf16_parameters

    check_setup(setup)
    shape = setup.mesh
    parallel = ParallelSection(
        dp_replicate=setup.dp_replicate,
        dp_shard=setup.dp_shard,
        tp=setup.tp,
        ep=setup.ep,
        activation_checkpointing=setup.activation_checkpointing,
        cpu_offload=setup.cpu_offload,
        reshard_after_forward=setup.reshard_after_forward,
    )
    notes = []
    with fake_process_group(setup.gpus):
        cpu = torch.device("cpu")
        if setup.gpus == 1:  # what distributed.setup() builds for one process: no mesh
            layout = Layout(
                rank=0, world_size=1, device=cpu, mesh=None, dp_rank=0, dp_size=1, tp_size=1
            )
        else:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_AXES)
            sparse_mesh = None
            if setup.ep > 1:  # as distributed.setup() splits dp_shard
                sizes = (shape[1] // setup.ep, setup.ep)
                sparse_mesh = mesh._unflatten("dp_shard", sizes, SPARSE_AXES[1:3])
            layout = Layout(
                rank=0,
                world_size=setup.gpus,
                device=cpu,
                mesh=mesh,
                dp_rank=0,
                dp_size=shape[0] * shape[1],
                tp_size=shape[2],
                ep_size=setup.ep,
                sparse_mesh=sparse_mesh,
            )
        model = _build(setup, layout, parallel, lora=setup.uses_lora)
        if setup.master_weights:  # what lmforge.train.adamw.AdamW(bf16_params=True) does
            to_bf16_parameters(model)
            notes.append("bf16 weights; the optimizer holds their fp32 masters (optim.bf16_params)")
        tensors = _shards(model)
        reference = {}
        if setup.reference == "frozen_copy":  # lmforge.train.dpo builds it like the policy
            frozen = _build(setup, layout, parallel, lora=False).requires_grad_(False)
            if setup.master_weights:  # in bf16, as the policy's weights
                to_bf16_parameters(frozen)
            reference = _shards(frozen)
    # What the trainer's optimizer would hold: build_optimizer's groups are the trainable
    # parameters; AdamW allocates its states like each (local) parameter.
    grad_bytes = setup.grad_bytes
    optimizer_bytes = setup.optimizer_bytes
    nf4_names = set()
    measured = {"parameters (trainable)": 0, "parameters (frozen)": 0}
    for t in tensors.values():
        nbytes = math.prod(t.local_shape) * t.dtype.itemsize
        measured["parameters (trainable)" if t.trainable else "parameters (frozen)"] += nbytes
    if setup.method == "qlora":
        # NF4 needs real weights (the trainer quantizes after loading): count the adapted
        # bases' stored bytes from their shapes, as quantize_base_nf4 will store them.
        from lmforge.modules.lora import lora_base_names

        nf4_names = set(lora_base_names(model))
        for name in nf4_names:
            t = tensors[name]
            numel = math.prod(t.local_shape)
            measured["parameters (frozen)"] += (
                nf4_bytes(numel, t.dtype.itemsize) - numel * t.dtype.itemsize
            )
        notes.append(
            "NF4 bases: quantization needs real weights, so their bytes are torchao's NF4 "
            "layout applied to the dry run's shapes"
        )
    trainable = sum(math.prod(t.local_shape) for t in tensors.values() if t.trainable)
    measured["gradients"] = trainable * grad_bytes
    measured["optimizer states"] = trainable * optimizer_bytes
    if reference:
        measured["reference model"] = sum(
            math.prod(t.local_shape) * t.dtype.itemsize for t in reference.values()
        )
    if setup.cpu_offload:
        notes.append("CPU offload: these shards live in host memory (FSDP2 CPUOffloadPolicy)")

    # ---- the arithmetic, tensor by tensor ----------------------------------------------
    specs = {s.name: s for s in param_specs(setup)}
    arithmetic = {"parameters (trainable)": 0, "parameters (frozen)": 0}
    mismatches = []
    for name, spec in specs.items():
        want = local_shape(spec, setup)
        got = tensors.get(name)
        if got is None:
            mismatches.append(f"{name}: in the arithmetic, not in the model")
            continue
        if got.local_shape != want or got.trainable != spec.trainable:
            mismatches.append(
                f"{name}: dry run {list(got.local_shape)} trainable={got.trainable}, "
                f"arithmetic {list(want)} trainable={spec.trainable}"
            )
        nbytes = parameter_bytes(spec, setup)
        arithmetic["parameters (trainable)" if spec.trainable else "parameters (frozen)"] += nbytes
    mismatches += [f"{n}: in the model, not in the arithmetic" for n in tensors if n not in specs]
    trainable_arith = sum(math.prod(local_shape(s, setup)) for s in specs.values() if s.trainable)
    arithmetic["gradients"] = trainable_arith * grad_bytes
    arithmetic["optimizer states"] = trainable_arith * optimizer_bytes
    if reference:
        base = setup.replace(method="full")
        base_specs = {s.name: s for s in param_specs(base)}
        arithmetic["reference model"] = sum(
            math.prod(local_shape(s, base)) * base.param_bytes for s in base_specs.values()
        )
        for name, spec in base_specs.items():
            got = reference.get(name)
            if got is None or got.local_shape != local_shape(spec, base):
                mismatches.append(f"reference {name}: shard shape differs")
    return DryRun(
        setup=setup,
        tensors=tensors,
        reference_tensors=reference,
        measured=measured,
        arithmetic=arithmetic,
        mismatches=mismatches,
        notes=notes,
    )
