"""AdamW and the learning-rate schedule (linear warmup, then cosine / linear / constant)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.train.config import OptimSection, SchedulerSection


def build_optimizer(model: nn.Module, cfg: OptimSection, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norms and 1-d parameters get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    hyper = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps}
    if cfg.compile:
        return CompiledAdamW(groups, **hyper)
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(groups, **hyper, fused=fused, foreach=None if fused else True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (AdamW is elementwise: shards update independently)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    lr: torch.Tensor,
    grad_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One parameter's AdamW step with decoupled weight decay, in place, the arithmetic of
    PyTorch's fused kernel: the gradient divided by `grad_scale`, nothing (the step count
    included) changed where `found_inf` is 1. Compiled, it is one generated kernel that reads
    the parameter, gradient and both moments once and writes the three back."""
    skip = found_inf > 0
    new_step = step + 1
    grad = grad.float() / grad_scale  # fp32 arithmetic whatever the storage dtype
    avg, avg_sq = exp_avg.float(), exp_avg_sq.float()
    new_avg = avg + (1 - beta1) * (grad - avg)
    new_avg_sq = avg_sq * beta2 + (1 - beta2) * grad * grad
    bias_correction1 = 1 - beta1**new_step
    bias_correction2_sqrt = (1 - beta2**new_step).sqrt()
    denom = new_avg_sq.sqrt() / bias_correction2_sqrt + eps
    decayed = param.float() * (1 - lr * weight_decay)
    new_param = decayed - (lr / bias_correction1) * new_avg / denom
    param.copy_(torch.where(skip, param, new_param))
    exp_avg.copy_(torch.where(skip, exp_avg, new_avg))
    exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, new_avg_sq))
    step.copy_(torch.where(skip, step, new_step))


class CompiledAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose update is compiled by torch.compile: one kernel per parameter
    reading each byte once (the fused CUDA kernel read the 1B model's fp32 state at 2.97 TB/s
    of an H200's 4.28). One graph serves every parameter, each seen as a flat vector of
    symbolic length (the update is elementwise): one compile, and no temporaries beyond one
    parameter's. Its state (and so its checkpoints) is
    the fused AdamW's, flags included (checkpoints resume with either), and like the fused
    kernel it takes `grad_scale` (clipping as a divisor) and `found_inf` (skip the step on the
    device) as attributes set before `step()`."""

    def __init__(self, params, **hyper) -> None:
        super().__init__(params, **hyper, fused=True)
        self._update = torch.compile(_adamw_update, fullgraph=True, dynamic=True)

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(param).device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("CompiledAdamW takes no closure")
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            device = _local(params[0]).device
            scalars = (
                torch.full((), group["lr"], dtype=torch.float32, device=device),
                _scalar(grad_scale, 1.0, device),
                _scalar(found_inf, 0.0, device),
            )
            beta1, beta2 = group["betas"]
            hyper = {"beta1": beta1, "beta2": beta2, "eps": group["eps"]}
            for param in params:
                state = self._state_of(param)
                flat = [
                    _flat(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
                ]
                self._update(
                    *flat, state["step"], *scalars, **hyper, weight_decay=group["weight_decay"]
                )


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of `tensor` as one vector sharing its storage."""
    return _local(tensor).view(-1)


def _scalar(value: torch.Tensor | None, default: float, device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor on `device`: `value`, or `default` where it is None (one compiled
    graph for both cases)."""
    if value is None:
        return torch.full((), default, dtype=torch.float32, device=device)
    return value.reshape(()).float().to(device, non_blocking=True)


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
