"""AdamW and the learning-rate schedule (linear warmup, then cosine / linear / constant)."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.train.config import OptimSection, SchedulerSection

TRITON_ADAMW = True  # benchmarks switch it off to measure what it gives


def build_optimizer(
    model: nn.Module, cfg: OptimSection, device: torch.device, *, bf16_params: bool = False
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms and 1-d parameters get no weight decay. Fused
    on a GPU: lmforge's Triton update (`lmforge.train.adamw`), else PyTorch's fused kernel.
    bf16_params: the trainable parameters become bf16 with fp32 masters in the optimizer (where
    lmforge's update takes them all; see `lmforge.train.adamw.AdamW`)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    meshes = []  # expert parallelism: the experts' DTensors are on a mesh of their own
    for param in decay + no_decay:
        mesh = _mesh(param)
        if mesh not in meshes:
            meshes.append(mesh)
    if len(meshes) > 1:  # foreach updates take one mesh per list: a group per mesh
        groups = [
            {**group, "params": [p for p in group["params"] if _mesh(p) == mesh]}
            for group in groups
            for mesh in meshes
        ]
    groups = [g for g in groups if g["params"]]
    options = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    if fused and device.type == "cuda":
        from lmforge.train.adamw import AdamW  # imports Triton

        return AdamW(groups, kernel=TRITON_ADAMW, bf16_params=bf16_params, **options)
    return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True, **options)


def _mesh(param: torch.Tensor):
    return param.device_mesh if isinstance(param, DTensor) else None


def to_bf16_parameters(module: nn.Module) -> None:
    """The module's parameters in bf16, in place (buffers, such as RoPE's, stay as they are)."""
    for param in module.parameters():
        param.data = param.data.to(torch.bfloat16)


def masters_in_params(optimizer: torch.optim.Optimizer | None):
    """A context in which bf16 parameters with fp32 masters hold their masters (state dicts,
    loading, export: `lmforge.train.adamw.AdamW.masters_in_params`); for any other optimizer
    nothing changes."""
    enter = getattr(optimizer, "masters_in_params", None)
    return enter() if enter is not None else contextlib.nullcontext()


def lr_factor(step: int, *, total_steps: int, cfg: SchedulerSection) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        shape = 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer, cfg: SchedulerSection, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps=total_steps, cfg=cfg)
    )
