"""Products of a few rows of activations (2-128: batched decoding) with int8 or int4 weights,
the weights dequantized in registers, tile by tile, and multiplied on the tensor cores.

Before this kernel, several rows met a quantized weight expanded to bf16 in memory first
(`dequantize`), then multiplied by cuBLAS: a decode step of 64 sequences wrote and read back
the whole bf16 model besides the quantized bytes, 2.5-4x the bytes bf16 itself reads, and the
int4 1B served 64 streams at 0.28x bf16 (docs/benchmarks.md). Here each program streams a
[BLOCK_N, BLOCK_K] tile of quantized bytes once, makes it x's dtype and takes `tl.dot` with the
[BLOCK_M, BLOCK_K] rows of x, so a step reads the quantized bytes and nothing more. Two
choices (`VARIANT`, measured in docs/benchmarks.md): the dequantized tile as the product's left
operand (`_product`), and its arithmetic in bf16 (`_int4_tile`, `_int8_tile`).

Layouts as `lmforge.generate.kernels` keeps them: int8 q [N, K] (uint8 q + 128 when
`INT8_OFFSET`), w = q * scale; int4 uint8 [N, K/2], byte j holding q[j] in its low nibble and
q[j + K/2] in its high one, w = (q - 8) * scale + zero; scale and zero [N, K / group]. An int4
tile therefore covers columns k0.. and K/2 + k0.. with two dots. A tile never crosses a group
(BLOCK_K divides the group), so each tile row takes one scale.

Small batches give few output tiles (the 1B's attention output: 2048 columns, 32 tiles of 64),
too few for 132 SMs: then 2 or 4 programs share a tile's K (`_splits`), and the last of them to
finish adds their sums and stores the tile, in the same kernel (no zeroed buffer, no second
kernel: each costs microseconds, times seven products a block). Tiles are autotuned per (rows,
N, K) on the first call, which the engine makes while warming up, before any CUDA graph
records.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from lmforge.generate.early_launch import INTERPRETED
from lmforge.generate.kernels.tiles import autotune

# None: the faster on one H200 (2026-12-04, benchmarks/quantized_gemm.py, the 1B's products;
# docs/benchmarks.md): swap for int4 and for int8 past 16 rows, fast for bf16 rows. The
# benchmark and the tests set each variant.
VARIANT: dict[str, bool | None] = {"swap": None, "fast": None}
MAX_ROWS = 128  # more rows (prefill chunks) are compute-bound: expansion + cuBLAS is faster


def _configs() -> list[triton.Config]:
    if INTERPRETED:  # one small tile: the CPU tests run every program in Python
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4)]
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
        for n, k, w, st in (
            (64, 64, 4, 4),
            (64, 128, 4, 3),
            (128, 64, 4, 4),
            (32, 128, 4, 4),
            (32, 64, 4, 4),
            (64, 256, 8, 3),
        )
    ]


def _fits(configs, named_args, **kwargs):
    """Tiles that fit the weight: BLOCK_K divides the group (one scale a tile) and the stored
    row splits evenly into SPLIT_K runs of whole tiles."""
    stored, group, splits = named_args["STORED"], kwargs["GROUP"], kwargs["SPLIT_K"]
    kept = [
        c
        for c in configs
        if group % c.kwargs["BLOCK_K"] == 0 and stored % (c.kwargs["BLOCK_K"] * splits) == 0
    ]
    return kept or [_smallest(stored // splits, group)]


def _smallest(span: int, group: int) -> triton.Config:
    block_k = 16
    while group % (block_k * 2) == 0 and span % (block_k * 2) == 0 and block_k < 64:
        block_k *= 2
    return triton.Config({"BLOCK_N": 32, "BLOCK_K": block_k}, num_warps=4)


# the picks kept in Triton's cache, as the GEMV's: a server started again on this GPU does not
# tune every bucket's products again (the int4 1B's took 198 s to start, bf16 74 s, on an H200)
@autotune(
    _configs(), key=["M", "N", "STORED", "GROUP", "BITS", "SPLIT_K", "SWAP", "FAST"], prune=_fits
)
@triton.jit
def _quantized_gemm(
    x_ptr,  # [M, K] activations
    q_ptr,  # int8/uint8 [N, K] (8 bits) or uint8 [N, K/2] (4 bits)
    scale_ptr,  # [N, K / GROUP]
    zero_ptr,  # [N, K / GROUP] (4 bits)
    y_ptr,  # [M, N] in x's dtype
    partial_ptr,  # fp32 [SPLIT_K, MAX_ROWS, N]: split-K's sums (`_workspace`)
    count_ptr,  # int32, one a tile: split-K's programs done, back to 0 after each launch
    M,
    N,
    STORED,  # bytes a weight row: K (8 bits) or K / 2 (4 bits)
    stride_x,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED_DOT: tl.constexpr,  # of fp32 products: "ieee" for an fp32 model, not tf32's 10 bits
    SWAP: tl.constexpr,  # the weight tile as the product's left operand (`_product`)
    FAST: tl.constexpr,  # dequantize in bf16 arithmetic (bf16 x only)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # of x and y
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # of y: rows of the weight
    row_ok, col_ok = rows < M, cols < N
    span = STORED // SPLIT_K  # whole tiles (`_fits`)
    begin = tl.program_id(2) * span
    groups = (2 * STORED if BITS == 4 else STORED) // GROUP
    dtype = x_ptr.dtype.element_ty
    # the interpreter's tl.dot gets bf16 wrong (numpy has no bf16): there, products in fp32 of
    # the same bf16-rounded operands
    dot_dtype = tl.float32 if INTERPRETED_DOT else dtype
    if SWAP:  # y.T = w x.T: the weight tile is the product's left operand (see `_product`)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(begin, begin + span, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + cols[:, None] * STORED + ks[None, :], mask=col_ok[:, None], other=0)
        at = cols * groups + k0 // GROUP  # the tile's group, one a weight row
        x = _rows(x_ptr, rows, row_ok, ks, stride_x, SWAP).to(dot_dtype)
        if BITS == 8:
            w = _int8_tile(q, scale_ptr, at, col_ok, dtype, FAST)
        else:  # low nibbles: columns k0.., high ones: STORED + k0.. (their own group)
            w = _int4_tile(q & 0xF, scale_ptr, zero_ptr, at, col_ok, dtype, FAST)
        acc = _product(acc, x, w.to(dot_dtype), SWAP, PRECISION)
        if BITS == 4:
            x = _rows(x_ptr, rows, row_ok, STORED + ks, stride_x, SWAP).to(dot_dtype)
            w = _int4_tile(q >> 4, scale_ptr, zero_ptr, at + STORED // GROUP, col_ok, dtype, FAST)
            acc = _product(acc, x, w.to(dot_dtype), SWAP, PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:  # the tile's last program to finish adds the SPLIT_K sums and stores them
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        at = rows[:, None] * N + cols[None, :]
        tl.store(partial_ptr + tl.program_id(2) * MAX_ROWS * N + at, acc, mask=ok)
        tl.debug_barrier()  # every thread's sums stored before the count
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # in order: one sum, whoever ends last
                acc += tl.load(partial_ptr + split * MAX_ROWS * N + at, mask=ok, other=0,
                               cache_modifier=".cg")  # fmt: skip
            tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=ok)
            tl.store(count_ptr + tile, 0)
    else:
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rows(x_ptr, rows, row_ok, ks, stride_x, SWAP: tl.constexpr):
    """x's [BLOCK_M, BLOCK_K] tile at columns `ks`, or its transpose when SWAP."""
    # (one return: Triton's code generator also reads the return after a constant `if` that
    # returned, and refuses two of different shapes)
    if SWAP:
        at = x_ptr + rows[None, :] * stride_x + ks[:, None]
        tile = tl.load(at, mask=row_ok[None, :], other=0)
    else:
        tile = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None], other=0
        )
    return tile


@triton.jit
def _product(acc, x, w, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x @ w.T ([BLOCK_M, BLOCK_N]), or acc + w @ x.T when SWAP: the dequantized tile,
    in registers, as the left operand, which Hopper's warpgroup products read from registers
    (the right one must come from shared memory), and the few rows as the product's narrow
    side (8 or more, where the left side's rows must be 64)."""
    if SWAP:
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _int8_tile(q, scale_ptr, at, col_ok, dtype, FAST: tl.constexpr):
    """w = q * scale for a [BLOCK_N, BLOCK_K] tile of int8 q (or uint8 q + 128), in `dtype`.
    (One return in these helpers: Triton reads the return after a constant `if` that returned
    too, and refuses two of different types.)"""
    if q.dtype == tl.uint8:  # q + 128 (`INT8_OFFSET`)
        q = q.to(tl.int16) - 128
    if FAST:  # bf16 arithmetic (two values an instruction): the integers are exact in bf16
        scale = tl.load(scale_ptr + at, mask=col_ok, other=0)[:, None]
        w = q.to(dtype) * scale
    else:
        scale = tl.load(scale_ptr + at, mask=col_ok, other=0).to(tl.float32)[:, None]
        w = (q.to(tl.float32) * scale).to(dtype)
    return w


@triton.jit
def _int4_tile(nibbles, scale_ptr, zero_ptr, at, col_ok, dtype, FAST: tl.constexpr):
    """w = (q - 8) * scale + zero for a [BLOCK_N, BLOCK_K] tile of 4-bit q (uint8 0..15)."""
    scale = tl.load(scale_ptr + at, mask=col_ok, other=0)[:, None]
    zero = tl.load(zero_ptr + at, mask=col_ok, other=0)[:, None]
    if FAST:  # bf16 0x4300 | q is 128 + q: no integer conversion; minus 136, exact, is q - 8
        values = (nibbles.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
        w = values.to(dtype) * scale + zero
    else:
        values = nibbles.to(tl.float32) - 8.0
        w = (values * scale.to(tl.float32) + zero.to(tl.float32)).to(dtype)
    return w


def supported(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bits: int) -> bool:
    """Whether `quantized_gemm` takes these operands: 2..MAX_ROWS rows on CUDA (or the
    interpreter), 16-bit or fp32 activations, groups of at least 16 columns."""
    rows = x.numel() // x.shape[-1]
    stored = q.shape[1]
    k = 2 * stored if bits == 4 else stored
    group = k // scale.shape[1]
    return (
        1 < rows <= MAX_ROWS
        and (x.is_cuda or INTERPRETED)
        and group % 16 == 0
        and stored % 16 == 0
        and (bits == 8 or stored % group == 0)  # int4's halves start at a group boundary
    )


def quantized_gemm(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:
    """x [M, K] @ w.T for a quantized w (the module docstring's layouts): [M, N] in x's dtype.
    `supported` must hold."""
    m, n, stored = x.shape[0], q.shape[0], q.shape[1]
    k = 2 * stored if bits == 4 else stored
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    splits = _splits(x.device, triton.cdiv(m, block_m) * triton.cdiv(n, 64), stored)
    partial, count = _workspace(x.device, n)

    def grid(meta):
        return (triton.cdiv(m, block_m), triton.cdiv(n, meta["BLOCK_N"]), splits)

    _quantized_gemm[grid](
        x, q, scale, zero, y, partial, count, m, n, stored, x.stride(0),
        GROUP=k // scale.shape[1], BITS=bits, MAX_ROWS=MAX_ROWS, BLOCK_M=block_m, SPLIT_K=splits,
        PRECISION="ieee" if x.dtype == torch.float32 or INTERPRETED else "tf32",
        INTERPRETED_DOT=INTERPRETED, SWAP=_swap(bits, m),
        FAST=_fast(x, scale),
    )  # fmt: skip
    return y


def _fast(x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Dequantize in bf16 arithmetic: bf16 rows and scales (no scale rounded), compiled (the
    interpreter's numpy has no bf16 arithmetic)."""
    wanted = VARIANT["fast"] is not False and not INTERPRETED
    return wanted and x.dtype == scale.dtype == torch.bfloat16


def _swap(bits: int, rows: int) -> bool:
    if VARIANT["swap"] is not None:
        return VARIANT["swap"]
    return bits == 4 or rows > 16


def _splits(device: torch.device, tiles: int, stored: int) -> int:
    """How many programs share a tile's K: enough that the tiles' programs fill 3/4 of the SMs
    (at most 4, each a run of at least 512 bytes); 2 under the interpreter (the tests)."""
    if INTERPRETED:
        return 2 if stored % 64 == 0 else 1
    sms = _multiprocessors(device)
    splits = 1
    while tiles * splits < 3 * sms // 4 and splits < 4 and stored % (2 * splits * 512) == 0:
        splits *= 2
    return splits


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@cache
def _workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K's memory for products of N outputs on `device`: sums [4, MAX_ROWS, N] and the
    tiles' counts, zeros the kernel sets back to zero. Made once and kept (CUDA graphs that
    recorded it keep its address); products run one after another on it."""
    partial = torch.empty(4, MAX_ROWS, n, dtype=torch.float32, device=device)
    tiles = triton.cdiv(MAX_ROWS, 16) * triton.cdiv(n, 16)
    return partial, torch.zeros(tiles, dtype=torch.int32, device=device)
