"""The operators the layers call, registered with torch.library so that torch.compile treats
them as opaque kernels and a CUDA graph records them: `gemv` (one row, `_gemv` or `_gemv_int4`)
and `quantized_matmul` (several rows: the quantized weight expanded to x's dtype by
`_dequantize`, then one cuBLAS matmul: at 64 rows on an H200 torchao's int8 kernel took 0.6-4.8
ms a product of the 1B, this 10-57 us); and `one_row`, which of the two a layer takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lmforge.generate.early_launch import INTERPRETED
from lmforge.generate.kernels import int4_mma, quantized_gemm
from lmforge.generate.kernels.gemv_kernel import _launch_gemv
from lmforge.generate.kernels.int4 import _int4_values
from lmforge.generate.kernels.int8 import _int8_values


@triton.jit
def _dequantize(
    w_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,  # [N, K] in x's dtype
    N,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # stored columns a program expands: it divides GROUP
):
    """A [BLOCK_N, BLOCK_K] tile of stored columns, all in one group: a scale (and zero) a row,
    loaded once; the bytes made floats by the GEMV's conversions (`_int8_values`,
    `_int4_values`: no integer converter), a multiply-add a value."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * BLOCK_K
    cols = first + tl.arange(0, BLOCK_K)
    stored: tl.constexpr = K // 2 if BITS == 4 else K
    row_ok = rows < N
    q = tl.load(w_ptr + rows[:, None] * stored + cols[None, :], mask=row_ok[:, None], other=0)
    at = rows * (K // GROUP) + first // GROUP  # [BLOCK_N]: the tile's group of each row
    out = out_ptr + rows[:, None] * K + cols[None, :]
    scale = tl.load(scale_ptr + at, mask=row_ok, other=0).to(tl.float32)[:, None]
    if BITS == 8:  # int8, or uint8 q + 128
        tl.store(out, (_int8_values(q) * scale).to(out.dtype.element_ty), mask=row_ok[:, None])
    else:  # the low nibbles are columns 0..K/2-1, the high ones K/2..K-1; w = (n - 8)·s + z
        low, high = _int4_values(q)  # 128 + n/2 and 128 + 8n
        zero = tl.load(zero_ptr + at, mask=row_ok, other=0).to(tl.float32)[:, None]
        high_zero = tl.load(zero_ptr + at + stored // GROUP, mask=row_ok, other=0)
        high_scale = tl.load(scale_ptr + at + stored // GROUP, mask=row_ok, other=0)
        high_zero, high_scale = (
            high_zero.to(tl.float32)[:, None],
            high_scale.to(tl.float32)[:, None],
        )
        w_low = low * (2.0 * scale) + (zero - 264.0 * scale)
        w_high = high * (0.125 * high_scale) + (high_zero - 24.0 * high_scale)
        tl.store(out, w_low.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(out + stored, w_high.to(out.dtype.element_ty), mask=row_ok[:, None])


@torch.library.custom_op("lmforge::gemv", mutates_args=())
def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    bits: int = 16,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """One row of activations times a weight: [1, N]. The weight is plain (bits 16: [N, K],
    bf16, fp16, fp32) or quantized (`q`, `scale`, `zero` in the module docstring's layouts).
    What the decode step did around the product can happen inside it: `norm` (the RMSNorm
    weight, with `eps`): x [1, K] is the residual stream and the product takes its norm;
    `gated`: x is SiLU·up, given as [1, 2K] gate and up (the product takes silu(gate) * up)
    or as [1, K] made already; `residual` [N]: it is added to the product; `swiglu`: the
    weight is [gate; up] and the output [1, N/2] is silu(gate) * up of the two halves."""
    return _launch_gemv(x, weight, scale, zero, bits, norm, eps, gated, residual, swiglu)


@gemv.register_fake
def _(x, weight, scale=None, zero=None, bits=16, norm=None, eps=0.0, gated=False, residual=None,
      swiglu=False):  # fmt: skip
    return x.new_empty(1, weight.shape[0] // 2 if swiglu else weight.shape[0])


@torch.library.custom_op("lmforge::quantized_matmul", mutates_args=())
def quantized_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    words: torch.Tensor | None = None,
    sz: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ w.T for a quantized w (module docstring's layouts) and several rows: int4
    with its `int4_mma.pack` copy (`words`, `sz`) and up to `int4_mma.MAX_ROWS` bf16 rows, in
    the CUDA kernel; otherwise up to `quantized_gemm.MAX_ROWS`, dequantized tile by tile in
    the product; more, w expanded to x's dtype, then one matmul: [M, N] in x's dtype."""
    if words is not None and x.dtype == torch.bfloat16 and x.shape[0] <= int4_mma.MAX_ROWS:
        return int4_mma.int4_mma(x, words, sz, group=2 * q.shape[1] // scale.shape[1])
    if quantized_gemm.supported(x, q, scale, bits):
        return quantized_gemm.quantized_gemm(x, q, scale, zero, bits)
    return F.linear(x, dequantize(q, scale, zero, bits, x.dtype))


@quantized_matmul.register_fake
def _(x, q, scale, zero, bits, words=None, sz=None):
    return x.new_empty(x.shape[0], q.shape[0])


def dequantize(q, scale, zero, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` from its quantized layout."""
    n, stored = q.shape
    k = 2 * stored if bits == 4 else stored
    out = torch.empty(n, k, dtype=dtype, device=q.device)
    group = k // scale.shape[1]
    block_k = 256  # the largest power of two up to 256 dividing the group (and the stored row)
    while group % block_k or stored % block_k:
        block_k //= 2
    block_n = min(64, 8192 // block_k)  # up to 8k values a program: 64 a thread of 4 warps
    grid = (triton.cdiv(n, block_n), stored // block_k)
    _dequantize[grid](
        q, scale, zero, out, n, k, GROUP=group, BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k
    )  # fmt: skip
    return out


def one_row(x: torch.Tensor) -> bool:
    """Whether x is a single row of activations where the GEMV runs (CUDA, the interpreter)."""
    return x.numel() == x.shape[-1] and (x.is_cuda or INTERPRETED)
