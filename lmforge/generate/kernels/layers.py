"""The modules that put the kernels in a model: `GemvLinear` (a plain weight),
`QuantizedLinear` (a torchao weight-only int8 or int4 weight in the kernels' layout, converted
by `quantized_values`) and `Float8Linear` (W8A8: float8 weights a scale a row, the input
quantized a row at run time), and the swaps that install them (`use_gemv`,
`use_quantized_kernels`). One row of activations goes through `gemv`; more through `F.linear`,
`quantized_matmul` or (float8) `torch._scaled_mm`.
"""

from __future__ import annotations

import logging
import os
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.generate.kernels import int4_mma
from lmforge.generate.kernels.int8 import stored_int8
from lmforge.generate.kernels.ops import gemv, one_row, quantized_matmul
from lmforge.generate.kernels.tiles import MIN_TILE
from lmforge.quantize.stored import float8_rows

log = logging.getLogger(__name__)
# int4 products of 2-64 rows in the CUDA kernel (`use_int4_mma`) where it builds: off unless
# LMFORGE_INT4_MMA=1, since its first version ran the 8B's layer slower than Triton's
# `quantized_gemm` at 1-64 rows (H100, 2026-12-08: docs/benchmarks.md, "Quantized")
INT4_MMA = os.environ.get("LMFORGE_INT4_MMA", "0") == "1"


class _MatvecLayer(nn.Module):
    """A bias-free linear whose single-row products run in `_gemv`; `matvec` takes what the
    decode step does around the product into the same kernel (`FusedDecodeBlock`). A subclass
    defines `weight_args()`: `gemv`'s weight arguments (weight or q, scale, zero, bits)."""

    def matvec(
        self,
        x: torch.Tensor,
        *,
        norm: nn.Module | None = None,
        gated: bool = False,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """One row x [..., K] -> [..., N]: the product of RMSNorm(x) with `norm` (an
        RMSNorm), of SiLU·up when `gated` (x [..., 2K], gate and up, or [..., K] made), plus
        `residual` [..., N]; `swiglu`: silu(gate) * up of the output's halves, [..., N/2]."""
        y = gemv(
            x.reshape(1, -1),
            *self.weight_args(),
            norm=norm.weight if norm is not None else None,
            eps=norm.eps if norm is not None else 0.0,
            gated=gated,
            residual=residual.reshape(-1) if residual is not None else None,
            swiglu=swiglu,
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])


class GemvLinear(_MatvecLayer):
    """A bias-free linear over a plain weight that multiplies one row of activations with
    `_gemv` (on CUDA, or under the interpreter) and more rows with `F.linear`. It holds the
    linear's own parameter, so state dicts and tied weights stay as they were."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def weight_args(self) -> tuple:
        return self.weight, None, None, 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matvec(x) if one_row(x) else F.linear(x, self.weight)


class QuantizedLinear(_MatvecLayer):
    """A bias-free linear over a quantized weight in the kernels' layout (module docstring):
    `from_linear` converts a torchao weight-only linear, `concatenate` joins several along
    their outputs (fused projections). Inference only: the weight is buffers, not parameters.
    One row goes through `_gemv`; more through bf16 expansion and one matmul."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int):
        super().__init__()
        self.bits = bits
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.mma: tuple[torch.Tensor, torch.Tensor] | tuple[()] = ()  # `use_int4_mma`'s copy

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    def weight_args(self) -> tuple:
        return self.q, self.scale, self.zero, self.bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_row(x):
            return self.matvec(x)
        rows = x.reshape(-1, x.shape[-1])
        y = quantized_matmul(rows, self.q, self.scale, self.zero, self.bits, *self.mma)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @classmethod
    def from_linear(cls, linear: nn.Module, *, tinygemm: bool = False) -> QuantizedLinear | None:
        """The kernels' copy of a bias-free linear's torchao weight (int8 weight-only per row
        or group; int4 unpacked, as made on the CPU; tinygemm's int4 when `tinygemm`), or None
        for any other weight."""
        if type(linear) is not nn.Linear or linear.bias is not None:
            return None
        values = quantized_values(linear.weight.data, tinygemm=tinygemm)
        if values is None:
            return None
        bits, q, scale, zero = values
        if bits == 8:  # (q + 128 as uint8, which the byte permutes take as it is)
            q = stored_int8(q)
        if bits == 4:
            half = q.shape[1] // 2
            q = (q[:, :half] | (q[:, half:] << 4)).to(torch.uint8)  # [N, K/2]
        return cls(q.contiguous(), scale.contiguous(), zero.contiguous(), bits)

    @staticmethod
    def joinable(linears: list[nn.Module]) -> bool:
        """Whether `concatenate` takes `linears`: all of this type, one layout and group size."""
        first = linears[0]
        return all(
            type(lin) is QuantizedLinear
            and lin.bits == first.bits
            and lin.q.shape[1] == first.q.shape[1]
            and lin.scale.shape[1] == first.scale.shape[1]
            for lin in linears
        )

    @classmethod
    def concatenate(cls, linears: list[QuantizedLinear]) -> QuantizedLinear:
        """One linear whose outputs are `linears`' in order (`joinable`)."""
        first = linears[0]
        if not cls.joinable(linears):
            raise ValueError("only linears of one layout and group size can be joined")
        joined = [
            torch.cat([getattr(lin, name) for lin in linears]) for name in ("q", "scale", "zero")
        ]
        return cls(*joined, first.bits)


def quantized_values(weight: torch.Tensor, *, tinygemm: bool = False):
    """(bits, q [N, K], scale [N, groups], zero [N, groups]) of a torchao weight-only tensor,
    w = q * scale (bits 8) or (q - 8) * scale + zero (bits 4, q in 0..15); None for a layout
    these kernels do not read (activation quantization, pre-scales, other formats). tinygemm's
    int4 (`Int4TilePackedTo4dTensor`) only when `tinygemm`: at one row `_gemv_int4` is faster
    than tinygemm, at many bf16 expansion + cuBLAS is."""
    kind = type(weight).__name__
    known = {"Int8Tensor", "IntxUnpackedToInt8Tensor"}
    if tinygemm:
        known.add("Int4TilePackedTo4dTensor")
    if kind not in known:
        return None
    if getattr(weight, "act_quant_kwargs", None) is not None:
        return None
    if getattr(weight, "act_pre_scale", None) is not None:
        return None
    n, k = weight.shape
    if k % (2 * MIN_TILE) or weight.block_size[-1] % MIN_TILE:
        return None  # rows or groups the GEMV's narrowest tile does not divide
    if kind == "Int8Tensor":
        if weight.zero_point is not None and bool(weight.zero_point.any()):
            return None
        scale = weight.scale.reshape(n, -1)
        return 8, weight.qdata, scale, scale.new_empty(n, 0)  # no zero (symmetric)
    if (k // 2) % weight.block_size[-1]:
        return None  # int4 pairs q[j], q[j + K/2] must sit in whole groups
    if kind == "IntxUnpackedToInt8Tensor" and weight.target_dtype == torch.int4:
        scale = weight.scale.reshape(n, -1)
        zero = -weight.zero_point.reshape(n, -1).to(scale.dtype) * scale  # w = (q - zp) s
        return 4, (weight.qdata.to(torch.int16) + 8).to(torch.uint8), scale, zero
    if kind == "Int4TilePackedTo4dTensor":
        return _tinygemm_values(weight)
    return None  # int8 as the storage of other integer widths


def _tinygemm_values(weight: torch.Tensor):
    """tinygemm's int4 values, recovered exactly from its packed tiles: the kernel applied to
    rows of the identity gives the dequantized weight, (q - 8) * scale + zero, in bf16."""
    n, k = weight.shape
    group = weight.block_size[-1]
    pairs = weight.scale_and_zero.transpose(0, 1)  # [N_padded, K_padded / group, 2]
    scale = pairs[:n, : k // group, 0].contiguous()
    zero = pairs[:n, : k // group, 1].contiguous()
    padded_k = weight.scale_and_zero.shape[0] * group
    q = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
    for start in range(0, k, 2048):
        stop = min(start + 2048, k)
        eye = torch.zeros(stop - start, padded_k, dtype=torch.bfloat16, device=weight.device)
        at = torch.arange(stop - start, device=weight.device)
        eye[at, start + at] = 1
        w = torch.ops.aten._weight_int4pack_mm(eye, weight.qdata, group, weight.scale_and_zero)
        w = w[:, :n].t().float()  # [N, columns start..stop]
        cols = torch.arange(start, stop, device=weight.device) // group
        s, z = scale[:, cols].float(), zero[:, cols].float()
        values = torch.round((w - z) / s + 8).clamp_(0, 15)
        if not bool((((values - 8) * s + z - w).abs() <= 0.25 * s.abs()).all()):
            return None  # a value the formula does not give back: keep torchao's kernel
        q[:, start:stop] = values.to(torch.uint8)
    return 4, q, scale, zero


class Float8Linear(_MatvecLayer):
    """A bias-free linear over float8 e4m3 `values` [N, K] with `scale` [N] (fp32), w = values *
    scale a row (`lmforge quantize --scheme fp8`, compressed-tensors' FP8-dynamic). Several rows
    of input are quantized a row at a time (amax / 448) and multiplied on the float8 tensor
    cores by `torch._scaled_mm` with both scales applied to its fp32 sums. One row (batch-1
    decode) reads the float8 weights in `_gemv` instead, its input unquantized (a weight-only
    product): there the product is bound by the weight's bytes, and `_scaled_mm` with the
    input's quantization took longer than bf16's GEMV (the 1B decoded at 695 tok/s against
    985, H100, 2026-12-07); `FusedDecodeBlock` takes it as it takes int8. `from_linear` takes torchao's
    per-row `Float8Tensor` (as `lmforge.load` makes it); `concatenate` joins several along their
    outputs (fused q/k/v and gate/up: one product instead of three or two). Inference only."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("values", values)
        self.register_buffer("scale", scale.reshape(1, -1).float())  # [1, N]: _scaled_mm's b

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    def weight_args(self) -> tuple:
        return self.values, self.scale.view(-1, 1), None, 8  # (one scale a row: [N, 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_row(x):
            return self.matvec(x)
        # the input's float8 copy and [M, 1] fp32 scales (the compiled decode step fuses these)
        quantized, scale = float8_rows(x.reshape(-1, x.shape[-1]))
        y = torch._scaled_mm(
            quantized, self.values.t(), scale_a=scale, scale_b=self.scale,
            out_dtype=x.dtype, use_fast_accum=True,
        )  # fmt: skip
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Float8Linear | None:
        """The layer of a bias-free linear whose weight is torchao's per-row float8 tensor with
        per-row activation quantization, or None for any other."""
        if type(linear) is not nn.Linear or linear.bias is not None:
            return None
        weight = linear.weight.data
        if type(weight).__name__ != "Float8Tensor" or weight.qdata.dtype != torch.float8_e4m3fn:
            return None
        if list(weight.block_size) != [1, weight.shape[1]] or weight.act_quant_kwargs is None:
            return None  # one scale a row, activations quantized at run time: nothing else
        n, k = weight.shape
        if weight.device.type == "cuda" and (weight.dtype != torch.bfloat16 or n % 16 or k % 16):
            return None  # row-wise scaled products on CUDA: bf16 out, sizes in 16s (torchao's)
        return cls(weight.qdata, weight.scale.reshape(-1))

    @staticmethod
    def joinable(linears: list[nn.Module]) -> bool:
        """Whether `concatenate` takes `linears`: all of this type, one input size."""
        width = linears[0].values.shape[1]
        return all(type(lin) is Float8Linear and lin.values.shape[1] == width for lin in linears)

    @classmethod
    def concatenate(cls, linears: list[Float8Linear]) -> Float8Linear:
        if not cls.joinable(linears):
            raise ValueError("only float8 linears of one input size can be joined")
        values = torch.cat([lin.values for lin in linears])
        return cls(values, torch.cat([lin.scale.reshape(-1) for lin in linears]))


def use_quantized_kernels(model: nn.Module, *, tinygemm: bool = False) -> int:
    """Swap every torchao weight-only linear of `model` that these kernels read for a
    `QuantizedLinear` (tinygemm's int4 too when `tinygemm`), and every float8 one (W8A8) for a
    `Float8Linear`; returns how many were swapped."""
    weight_only = _swap(model, partial(QuantizedLinear.from_linear, tinygemm=tinygemm))
    return weight_only + _swap(model, Float8Linear.from_linear)


def use_int4_mma(model: nn.Module) -> int:
    """Give every int4 `QuantizedLinear` of `model` (after fusing) whose shape the CUDA
    product takes a copy in its layout (`int4_mma.pack`), read at 2-64 rows; the layer keeps
    its GEMV layout for one row. Returns how many; 0 while `INT4_MMA` is off, or where
    `int4_mma.available()` says why not (logged once)."""
    if not INT4_MMA:
        return 0  # (before walking the model: the engine calls this at every start)
    layers = [
        m for m in model.modules()
        if type(m) is QuantizedLinear and m.bits == 4 and m.q.is_cuda
        and m.scale.dtype == torch.bfloat16
        and int4_mma.supported(1, m.q.shape[0], 2 * m.q.shape[1], 2 * m.q.shape[1] // m.scale.shape[1])
    ]  # fmt: skip
    if not layers:
        return 0
    reason = int4_mma.available(layers[0].q.device.index or 0)
    if reason is not None:
        log.warning("int4 products of several rows stay in Triton: %s", reason)
        return 0
    for layer in layers:
        layer.mma = int4_mma.pack(layer.q, layer.scale, layer.zero)
        int4_mma.reserve(layer.q.shape[0], layer.q.device)
    return len(layers)


def use_gemv(model: nn.Module) -> int:
    """Swap every bias-free linear of `model` over a plain floating-point weight for a
    `GemvLinear` (same parameter); returns how many were swapped."""

    def swap(linear: nn.Module) -> GemvLinear | None:
        plain = (
            type(linear) is nn.Linear
            and linear.bias is None
            and type(linear.weight.data) is torch.Tensor
            and linear.weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and linear.in_features % MIN_TILE == 0  # (a LoRA's B of rank 8 stays)
        )
        return GemvLinear(linear.weight) if plain else None

    return _swap(model, swap)


def _swap(model: nn.Module, replacement) -> int:
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if child._forward_hooks or child._forward_pre_hooks:
                continue  # e.g. tensor parallelism's all-reduce after a row-parallel linear
            new = replacement(child)
            if new is not None:
                setattr(module, name, new)
                swapped += 1
    return swapped
