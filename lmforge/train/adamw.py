"""AdamW whose update on a GPU is one Triton kernel a parameter.

The update streams 28 bytes a parameter (fp32 parameter, gradient and both moments read;
parameter and moments written). PyTorch's fused AdamW runs it at ~69% of an H200's copy
bandwidth (2.95 TB/s) and, handed a `grad_scale` (how the trainer clips), also writes the
unscaled gradient back: 4 bytes more that the trainer drops right after. This kernel reads and
writes only what the update needs, at ~4.0 TB/s (1B: 8.7 against 11.7 ms a step). With bf16
parameters and fp32 masters (`bf16_params`) it is 28 bytes too: the bf16 gradient, the master
and the moments read; the master, the moments and the bf16 parameter written.

The optimizer is `torch.optim.AdamW` in every other respect: its param groups, its state
(`step` on the device, `exp_avg`, `exp_avg_sq`) and state dict, so checkpoints move between the
two; `grad_scale` and `found_inf` are honoured as the fused kernel honours them (every gradient
divided by the one; the whole update skipped, step count included, where the other is 1).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor

from lmforge.generate.early_launch import INTERPRETED

# Measured on an H200 (benchmarks/adamw_update.py, the 1B's and 3B's parameter shapes): blocks of
# 1,024 and 16 warps ran at 3.98-4.08 TB/s (PyTorch's fused AdamW: 2.95); 4,096 and 8 warps 3.2.
BLOCK = 1024  # elements a program
WARPS = 16


@triton.jit
def _adamw_update(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    step_ptr,  # fp32 scalar: the step count after this step
    grad_scale_ptr,  # fp32 scalar: every gradient is divided by it (HAS_SCALE)
    found_inf_ptr,  # fp32 scalar: 1 skips the update (HAS_INF)
    master_ptr,  # fp32 values of a bf16 parameter (HAS_MASTER)
    numel,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_INF:  # a skipped step touches nothing
        numel = tl.where(tl.load(found_inf_ptr) == 0, numel, 0)
    mask = offsets < numel
    step = tl.load(step_ptr)
    # 1 - beta^step, as exp2(step * log2(beta))
    correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    if HAS_SCALE:
        grad = grad / tl.load(grad_scale_ptr)
    # the value updated: the fp32 master of a bf16 parameter, else the parameter itself
    value_ptr = master_ptr if HAS_MASTER else param_ptr
    value = tl.load(value_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
    value = value * (1.0 - lr * weight_decay)
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / correction2_sqrt + eps
    value = value - (lr / correction1) * exp_avg / denom
    if HAS_MASTER:
        tl.store(master_ptr + offsets, value, mask=mask)
    tl.store(param_ptr + offsets, value.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (FSDP2, tensor parallelism); a tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _launchable(param: torch.Tensor) -> bool:
    local = _local(param)
    return local.is_contiguous() and (local.is_cuda or INTERPRETED)


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` (fused) whose `step` launches `_adamw_update` for each parameter.
    kernel=False, parameters it cannot take (off the GPU, e.g. FSDP2's CPU offload; not
    contiguous) or options it does not implement (amsgrad, maximize, a tensor lr) leave the
    step to PyTorch's fused kernel.

    bf16_params: the model's fp32 parameters become bf16 tensors, which the forward and backward
    compute with directly (no autocast casts of the weights, bf16 gradients), and the optimizer
    keeps their fp32 values as masters; the kernel updates a master and writes its bf16 rounding
    into the parameter. State dicts, loading and export see the masters (`masters_in_params`).
    Taken only where the kernel takes every parameter and none is a DTensor.

    The trainer hands clipping and the non-finite skip over as PyTorch's amp does, as the
    attributes `grad_scale` and `found_inf` (device scalars) set around `step()`."""

    def __init__(self, params, *, kernel: bool = True, bf16_params: bool = False, **options):
        super().__init__(params, fused=True, **options)
        groups = self.param_groups
        self.kernel = kernel and all(_launchable(p) for g in groups for p in g["params"])
        self.masters: dict[torch.Tensor, torch.Tensor] = {}  # bf16 parameter -> fp32 values
        self._in_params = False
        if bf16_params and self._takes():
            self._make_masters([p for g in groups for p in g["params"]])

    def _make_masters(self, params: list[torch.Tensor]) -> None:
        if any(isinstance(p, DTensor) or p.dtype != torch.float32 for p in params):
            return
        for param in params:
            self.masters[param] = param.detach().clone()
            param.data = param.data.to(torch.bfloat16)

    @contextlib.contextmanager
    def masters_in_params(self):
        """For the block, each bf16 parameter holds its fp32 master (what state dicts save,
        loading fills and export writes); after it, the bf16 values are written again from the
        masters, which a load may have changed. Re-entrant; nothing without masters."""
        if self._in_params or not self.masters:
            yield
            return
        low = {}
        for param, master in self.masters.items():
            low[param] = param.data
            param.data = master
        self._in_params = True
        try:
            yield
        finally:
            self._in_params = False
            for param, data in low.items():
                self.masters[param] = param.data
                data.copy_(param.data)
                param.data = data

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts the loaded moments to their parameter's dtype: the master's, fp32
        with self.masters_in_params():
            super().load_state_dict(state_dict)

    def _takes(self) -> bool:
        return self.kernel and not any(
            g["amsgrad"] or g["maximize"] or isinstance(g["lr"], torch.Tensor)
            for g in self.param_groups
        )

    @torch.no_grad()
    def step(self, closure=None):
        if not self._takes():
            if self.masters:
                raise RuntimeError("AdamW with fp32 masters: only its kernel updates them")
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            steps = [self._state(p)["step"] for p in params]
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            for param, step in zip(params, steps):
                state = self.state[param]
                local = _local(param)
                if not local.numel():
                    continue
                # in masters_in_params the parameter holds its master: updated as it is
                master = None if self._in_params else self.masters.get(param)
                _adamw_update[(triton.cdiv(local.numel(), BLOCK),)](
                    local,
                    _local(param.grad).contiguous(),
                    _local(state["exp_avg"]),
                    _local(state["exp_avg_sq"]),
                    step,
                    grad_scale if grad_scale is not None else step,
                    found_inf if found_inf is not None else step,
                    master if master is not None else local,
                    local.numel(),
                    float(group["lr"]),
                    float(beta1),
                    float(beta2),
                    float(group["eps"]),
                    float(group["weight_decay"]),
                    HAS_SCALE=grad_scale is not None,
                    HAS_INF=found_inf is not None,
                    HAS_MASTER=master is not None,
                    BLOCK=BLOCK,
                    num_warps=WARPS,
                )
            if found_inf is not None:  # a skipped step does not count (PyTorch's fused way)
                torch._foreach_sub_(steps, [found_inf] * len(steps))
        return loss

    def _state(self, param: torch.Tensor) -> dict:
        """The parameter's state, created as PyTorch's fused AdamW creates it (the moments of a
        bf16 parameter with fp32 master in fp32)."""
        state = self.state[param]
        if not state:
            like = self.masters.get(param, param)
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
        return state
