"""The output projection and the cross entropy of its logits as one autograd step.

`output_cross_entropy(hidden, output, labels)` is the sum over labels != IGNORE_INDEX of
-log softmax(output(hidden))[label], for a bias-free linear `output`. Unfused, a language model's loss passes over its logits
[tokens, vocab] five times or so (the loss's max and sum, then the backward's softmax read and
gradient write; with Llama 3's 128,256 entries a row that is 4.2 GB in bf16 at 8 × 2048
tokens). Here one Triton program a row finds the row's log-sum-exp and then writes the loss's
gradient over the logits in place: the gradient is made in the forward, and nothing passes
over the logits again until the backward's matmuls read them. The scale that backward brings
(the loss's divisor) goes onto the two small operands of those matmuls, not onto the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.data.sft import IGNORE_INDEX

LOG2E = tl.constexpr(1.4426950408889634)
# Measured on an H200 (benchmarks/output_loss.py, 16,384 rows of 128,256): 3.05-3.09 ms, 2.7 TB/s
# at one read and one write; 16 and 32 warps, blocks of 4,096 and 16,384, and grids of 1-4
# programs an SM striding over the rows (to find a row in L2 again) were no faster.
ROW_BLOCK = 8192  # logits a row read at a time (16 KB of bf16)
ROW_WARPS = 8


@triton.jit
def _cross_entropy_rows(
    logits_ptr,  # [rows, vocab], row stride `stride`; the gradient overwrites it
    labels_ptr,  # [rows] int64
    losses_ptr,  # [rows] fp32, out
    vocab,
    stride,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * stride
    label = tl.load(labels_ptr + row)
    ignored = label == ignore_index
    in_range = (label >= 0) & (label < vocab)
    target = tl.load(logits_ptr + label, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    columns = tl.arange(0, BLOCK)
    # Log-sum-exp in base 2, online: the running max and the sum of 2^(x - max).
    top = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    for start in range(0, vocab, BLOCK):
        x = tl.load(logits_ptr + start + columns, mask=start + columns < vocab, other=float("-inf"))
        x = x.to(tl.float32) * LOG2E
        new_top = tl.maximum(top, tl.max(x, axis=0))
        total = total * tl.exp2(top - new_top) + tl.sum(tl.exp2(x - new_top), axis=0)
        top = new_top
    lse2 = top + tl.log2(total)
    tl.store(losses_ptr + row, tl.where(ignored, 0.0, lse2 / LOG2E - target))
    if WRITE_GRAD:  # d loss / d logits = softmax - one-hot(label); zero for an ignored row
        keep = tl.where(ignored, 0.0, 1.0)
        for start in range(0, vocab, BLOCK):
            offsets = start + columns
            mask = offsets < vocab
            x = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * LOG2E
            grad = (tl.exp2(x - lse2) - tl.where(offsets == label, 1.0, 0.0)) * keep
            tl.store(logits_ptr + offsets, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_rows(
    logits, labels, losses, *, write_grad: bool, warps: int | None = None, block: int | None = None
) -> None:
    """losses[i] = the cross entropy of row i of logits [rows, vocab] (0 where labels[i] is
    IGNORE_INDEX), one program a row; with write_grad the rows become its gradient."""
    rows, vocab = logits.shape
    _cross_entropy_rows[(rows,)](
        logits,
        labels,
        losses,
        vocab,
        logits.stride(0),
        IGNORE_INDEX,
        WRITE_GRAD=write_grad,
        BLOCK=block or ROW_BLOCK,
        num_warps=warps or ROW_WARPS,
    )


class _OutputCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, write_grad: bool):
        """hidden [rows, dim], weight [vocab, dim] (one dtype), labels [rows] -> loss sum."""
        logits = hidden @ weight.t()  # [rows, vocab]; becomes d loss_sum / d logits
        losses = torch.empty(len(labels), dtype=torch.float32, device=hidden.device)
        if len(labels):
            cross_entropy_rows(logits, labels, losses, write_grad=write_grad)
        if write_grad:
            ctx.save_for_backward(hidden, weight, logits)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, grad_logits = ctx.saved_tensors
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad_logits @ weight).mul_(grad_loss)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_logits.t() @ (hidden * grad_loss)
        return grad_hidden, grad_weight, None, None


def fusable_output(output: nn.Module | None) -> bool:
    """Whether an output projection is one the kernel takes: a plain bias-free linear (not a
    quantized base, e.g. QLoRA's NF4 output projection of an untied model)."""
    return type(output) is nn.Linear and output.bias is None


def fusable(hidden: torch.Tensor, output: nn.Module) -> bool:
    """Whether the fused kernel serves, in the forward: such a projection on a GPU, whole (not
    sharded over the vocabulary by tensor parallelism)."""
    return (
        fusable_output(output)
        and hidden.is_cuda
        and type(output.weight) in (torch.Tensor, nn.Parameter)
        and not isinstance(hidden, DTensor)
    )


def output_cross_entropy(
    hidden: torch.Tensor, output: nn.Module, labels: torch.Tensor, *, kernel: bool | None = None
) -> torch.Tensor:
    """Sum over labels != IGNORE_INDEX of the cross entropy of output(hidden), in fp32.

    hidden [..., dim], output: the output projection (vocab outputs), labels [...]. Under
    autocast the matmul runs in its dtype (as the linear would). kernel: None = the fused
    kernel where it serves (`fusable`); elsewhere (the CPU, a vocab-sharded or quantized
    projection) the logits are made and `F.cross_entropy` takes them. True runs the kernel
    anyway (the CPU tests, under Triton's interpreter)."""
    if not (fusable(hidden, output) if kernel is None else kernel):
        logits = output(hidden).flatten(0, -2)
        return F.cross_entropy(
            logits.float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    hidden, labels, weight = hidden.flatten(0, -2), labels.flatten(), output.weight
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    elif hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    write_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(hidden.device.type, enabled=False):
        return _OutputCrossEntropy.apply(
            hidden.contiguous(), weight, labels.contiguous(), write_grad
        )
