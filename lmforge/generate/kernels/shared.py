"""What both GEMV kernels (`_gemv`, gemv_kernel.py; `_gemv_int4`, int4.py) share: a program's
rows (`_rows`; pairs of gate and up rows with SWIGLU), its share of a row under split-K
(`_split_begin`) and the sum of the shares without a second kernel (`_combine`), the store
rounded as the unfused block rounds (`_store`), the input with its norm or SiLU·up
(`_activation`); and on the host, a launch's output and grid (`_output`) and split-K's
workspace (`_workspace`).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl


@triton.jit
def _split_begin(span: tl.constexpr, SPLITS: tl.constexpr):
    """Where this program's share of a row starts (in the units `span` counts)."""
    if SPLITS > 1:
        return tl.program_id(1) * span
    return 0


@triton.jit
def _finish(
    y, y_ptr, residual_ptr, partial_ptr, count_ptr, rows, row_ok, N, BLOCK_N: tl.constexpr,
    RESIDUAL, SWIGLU, SPLITS: tl.constexpr,
):  # fmt: skip
    """`_store` y, once a row block's SPLITS programs have all summed their columns."""
    if SPLITS > 1:
        y, last = _combine(y, partial_ptr, count_ptr, rows, row_ok, N, SPLITS)
        if last:
            _store(y, y_ptr, residual_ptr, rows, row_ok, N, BLOCK_N, RESIDUAL, SWIGLU)
    else:
        _store(y, y_ptr, residual_ptr, rows, row_ok, N, BLOCK_N, RESIDUAL, SWIGLU)


@triton.jit
def _combine(y, partial_ptr, count_ptr, rows, row_ok, N, SPLITS: tl.constexpr):
    """Split-K without a second kernel: each of a row block's programs stores its sums, then
    counts itself done (an atomic that publishes the stores); the last one adds the SPLITS sums
    in order (the same sum whichever finishes last) and sets the count back to 0 for the next
    launch. Returns (the sum, whether this program is the last)."""
    block = tl.program_id(0)
    tl.store(partial_ptr + tl.program_id(1) * N + rows, y, mask=row_ok)
    tl.debug_barrier()  # every thread's sums stored before the count
    done = tl.atomic_add(count_ptr + block, 1, sem="acq_rel")
    last = done == SPLITS - 1
    total = tl.zeros_like(y)
    if last:
        for split in tl.static_range(SPLITS):
            at = partial_ptr + split * N + rows
            total += tl.load(at, mask=row_ok, other=0, cache_modifier=".cg")  # (L2, not L1)
        tl.store(count_ptr + block, 0)
    return total, last


@triton.jit
def _rows(N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """A program's weight rows and which exist. SWIGLU: pairs (gate i, up i), rows i and N/2 + i
    side by side, for BLOCK_N / 2 outputs i."""
    if SWIGLU:
        at = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        return at + (tl.arange(0, BLOCK_N) % 2) * (N // 2), at < N // 2
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, rows < N


@triton.jit
def _store(y, y_ptr, residual_ptr, rows, row_ok, N, BLOCK_N: tl.constexpr, RESIDUAL, SWIGLU):
    """y [BLOCK_N] (fp32) out, rounded as the unfused block rounds: the product, then the
    residual's sum (RESIDUAL); the gate and up, silu(gate), then its product with up (SWIGLU)."""
    dtype = y_ptr.dtype.element_ty
    if SWIGLU:
        gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), [BLOCK_N // 2, 2]))
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        at = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + at, (silu * up).to(dtype), mask=at < N // 2)
    else:
        if RESIDUAL:
            residual = tl.load(residual_ptr + rows, mask=row_ok, other=0).to(tl.float32)
            y = y.to(dtype).to(tl.float32) + residual
        tl.store(y_ptr + rows, y.to(dtype), mask=row_ok)


@triton.jit
def _activation(x_ptr, norm_ptr, cols, K, squares, NORM: tl.constexpr, GATED: tl.constexpr):
    """(the product's input at `cols` in fp32, `squares` + x^2 there when NORM). GATED: silu(gate)
    * up, rounded where the unfused block rounds; NORM: x times the norm's weight (the 1 / rms
    factor comes at the end, so the GEMV reads x once)."""
    dtype = x_ptr.dtype.element_ty
    if GATED:
        gate = tl.load(x_ptr + cols).to(tl.float32)
        up = tl.load(x_ptr + K + cols).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        return (silu * up).to(dtype).to(tl.float32), squares
    x = tl.load(x_ptr + cols).to(tl.float32)
    if NORM:
        return x * tl.load(norm_ptr + cols).to(tl.float32), squares + x * x
    return x, squares


def _output(x: torch.Tensor, n: int, swiglu: bool):
    """A product's output [1, N] (or [1, N/2], `swiglu`) and its grid: a program a tile of
    rows and share of a row (`SPLITS`)."""
    width = n // 2 if swiglu else n
    y = torch.empty(1, width, dtype=x.dtype, device=x.device)
    return y, lambda meta: (triton.cdiv(width, meta["BLOCK_N"] // (1 + swiglu)), meta["SPLITS"])


def _split_workspace(device: torch.device, n: int, max_splits: int, y: torch.Tensor) -> tuple:
    """(partial sums, counts) for a launch: `_workspace`'s where rows may be split, else y
    twice (any pointer where unused)."""
    return _workspace(device, n, max_splits) if max_splits > 1 else (y, y)


@cache
def _workspace(device: torch.device, n: int, splits: int) -> tuple:
    """Split-K's memory for products of N rows on `device`: partial sums [splits, N] and the
    row blocks' counts [N], zeros that `_combine` sets back to zero. Made once and kept (CUDA
    graphs that recorded it keep its address); one product at a time uses it, since each kernel
    of the step starts on it only after the one before has finished."""
    partial = torch.empty(splits, n, dtype=torch.float32, device=device)
    return partial, torch.zeros(n, dtype=torch.int32, device=device)
