"""int4 weights times a few rows of bf16 activations (2-64: batched decoding) in a CUDA kernel
of our own (cuda/int4_mma.cu: the kernel's layouts and design are in its header), built at
first use by torch.utils.cpp_extension with nvcc and cached by torch (TORCH_EXTENSIONS_DIR).

Issue 56's product: Triton's int4 kernels (`quantized_gemm`) ran the 8B's layer at 1.0-1.6x
bf16's speed at 8-64 rows, far from the weights' bytes; fbgemm's CUTLASS product at 1.06-1.13x.
Here the weights are shuffled once at load (`pack`) into the tensor cores' fragment order, so
a lane's 16-byte load is its B fragments for eight mma tiles, converted to bf16 with two
bit operations and two fused multiply-adds a pair, several k steps of loads in flight a warp.

Off in the engine unless LMFORGE_INT4_MMA=1 (`layers.INT4_MMA`): measured on an H100
(2026-12-08), it is correct but slower than Triton's product at most of the 8B's shapes
(docs/benchmarks.md, "Quantized"). `available()` says whether the product runs here (CUDA, sm_80+, nvcc found and the build
done); without it the engine keeps `quantized_gemm` and says why once. `pack` and `unpack`
(the kernel's reading of the packed words, for the tests) run anywhere.
"""

from __future__ import annotations

import os
import shutil
from functools import cache
from pathlib import Path

import torch

SOURCES = Path(__file__).parent / "cuda"
MAX_ROWS = 64
# config of cuda/int4_mma.cu's launcher -> (row tiles of 16, columns a block, warps sharing K).
# 0-4: loads held in registers (4: 0 with the activations of 4 steps in flight; 6 or 8 steps of
# weights spill); 5-7: loads in cp.async rings in shared memory (`config` picks these)
CONFIGS = {0: (1, 128, 4), 1: (2, 128, 4), 2: (4, 128, 2), 3: (1, 256, 2), 4: (1, 128, 4),
           5: (1, 128, 4), 6: (2, 128, 4), 7: (4, 128, 4)}  # fmt: skip


def supported(rows: int, n: int, k: int, group: int) -> bool:
    """Whether the kernel takes these shapes: 1-64 rows, N a multiple of 128, groups of a
    multiple of 32 columns dividing K."""
    return 0 < rows <= MAX_ROWS and n % 128 == 0 and group % 32 == 0 and k % group == 0


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """The kernel's copy of an int4 weight in lmforge's layout (uint8 q [N, K/2], byte j =
    q[j] | q[j + K/2] << 4; scale, zero [N, K/g], bf16; w = (q - 8) * scale + zero):
    (int32 [N/64, K/32, 2, 32, 4] values, int32 [K/g, N/64, 8, 4, 2] (scale, zero) words)."""
    n, half = q.shape
    k, groups = 2 * half, scale.shape[1]
    values = torch.cat([q & 15, q >> 4], dim=1).to(torch.int64)  # [N, K]
    # n = 64c + 16j + 8w + gid, k = 32t + 8 tig + 4h + e  ->  [c, t, h, gid, tig, j, w, e]
    v = values.reshape(n // 64, 4, 2, 8, k // 32, 4, 2, 4).permute(0, 4, 6, 3, 5, 1, 2, 7)
    nibble = torch.tensor([[0, 4, 1, 5], [2, 6, 3, 7]], device=q.device)  # [w, e]
    words = (v << (4 * nibble)).sum(dim=(-1, -2))  # [c, t, h, gid, tig, j]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    bits = torch.stack([scale, zero], dim=-1).to(torch.bfloat16).view(torch.int16)  # [N, G, 2]
    pairs = (bits[..., 0].to(torch.int32) & 0xFFFF) | (bits[..., 1].to(torch.int32) << 16)
    # n = 64c + 16j + 8w + gid -> [G, c, gid, j, w]
    sz = pairs.reshape(n // 64, 4, 2, 8, groups).permute(4, 0, 3, 1, 2)
    return words.reshape(n // 64, k // 32, 2, 32, 4).contiguous(), sz.contiguous()


def unpack(words: torch.Tensor, sz: torch.Tensor, n: int, k: int):
    """What the kernel reads from `pack`'s output, as (values uint8 [N, K], scale [N, G],
    zero [N, G]) bf16: each word's bf16 pair p is `(word >> 4p) & 0x000f000f` (low half the
    fragment's first k), pairs 0, 1 column n0's b0 (mma k 2 tig, +1, physical +0, +1) and b1
    (mma k 2 tig + 8, +9, physical +2, +3), pairs 2, 3 column n1's."""
    w64 = words.to(torch.int64) & 0xFFFFFFFF  # [c, t, h, lane, j]
    values = torch.empty(n, k, dtype=torch.uint8)
    lane = torch.arange(32)
    gid, tig = lane // 4, lane % 4
    for p in range(4):
        pair = (w64 >> (4 * p)) & 0x000F000F
        low, high = pair & 0xF, (pair >> 16) & 0xF  # k and k + 1
        for c in range(n // 64):
            for j in range(4):
                col = 64 * c + 16 * j + 8 * (p // 2) + gid  # [32]
                for t in range(k // 32):
                    for h in range(2):
                        at = 32 * t + 8 * tig + 4 * h + 2 * (p % 2)
                        values[col, at] = low[c, t, h, :, j].to(torch.uint8)
                        values[col, at + 1] = high[c, t, h, :, j].to(torch.uint8)
    pairs = sz.permute(1, 3, 4, 2, 0).reshape(n, -1)  # [c, j, w, gid, G] -> [N, G]
    scale = (pairs & 0xFFFF).to(torch.int16).view(torch.bfloat16)
    zero = (pairs >> 16).to(torch.int16).view(torch.bfloat16)
    return values, scale, zero


def config(rows: int, n: int, k: int, processors: int) -> tuple[int, int]:
    """(the launcher's config, the blocks sharing K) for `rows` x [N, K]: about as many blocks
    as processors (a block of 8 warps fills one) where K allows, each warp with at least 4
    steps of 32 columns."""
    which = 5 if rows <= 16 else (6 if rows <= 32 else 7)
    _, columns, warps_k = CONFIGS[which]
    splits = min(round(processors / (n // columns)), k // (32 * 4 * warps_k))
    return which, max(1, min(splits, MAX_SPLIT_ROWS // rows))


# split blocks' sums: splits x rows at most this (16 splits of one row, 4 of 64)
MAX_SPLIT_ROWS = 4 * MAX_ROWS
# device -> (fp32 sums [MAX_SPLIT_ROWS * N], int32 counters [N / 128 + 1]) that the split
# blocks share, the counters kept at zero between products by the kernel itself; sized at
# load (`reserve`), before any CUDA graph records
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def reserve(n: int, device: torch.device) -> None:
    """Make the device's workspace large enough for products of N columns."""
    sums, _ = _workspaces.get(device, (None, None))
    if sums is None or sums.numel() < MAX_SPLIT_ROWS * n:
        _workspaces[device] = (
            torch.empty(MAX_SPLIT_ROWS * n, dtype=torch.float32, device=device),
            torch.zeros(n // 128 + 1, dtype=torch.int32, device=device),
        )


@cache
def available(device_index: int = 0) -> str | None:
    """None where the product runs on this CUDA device (the extension built and loaded), or
    the reason it does not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return f"compute capability {major}.{minor} (mma.sync bf16 needs 8.0)"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
    from torch.utils.cpp_extension import load

    arch = f"{major}{minor}"
    try:
        load(
            name=f"lmforge_int4_mma_sm{arch}",
            sources=[str(SOURCES / "int4_mma.cu"), str(SOURCES / "int4_mma_op.cpp")],
            extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # a compiler's failure: the Triton product stays
        return f"the build failed: {str(e).strip().splitlines()[-1][:200]}"
    return None


def int4_mma(
    x: torch.Tensor,
    words: torch.Tensor,
    sz: torch.Tensor,
    group: int,
    which: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [M, K] bf16 @ w.T for `pack`'s (words, sz): [M, N] bf16, with `config`'s launch
    unless `which` and `splits` are given (the benchmark's sweeps). `available()` must be None
    and `reserve` done for N; callers inside a compiled step go through the opaque
    `quantized_matmul` op."""
    m, k = x.shape
    n = words.shape[0] * 64
    if splits is not None and splits * m > MAX_SPLIT_ROWS:
        raise ValueError(f"{splits} splits of {m} rows: the workspace holds {MAX_SPLIT_ROWS} rows")
    if which is not None and (n % CONFIGS[which][1] or m > 16 * CONFIGS[which][0]):
        raise ValueError(f"config {which} takes {CONFIGS[which][1]}s of columns and at most "
                         f"{16 * CONFIGS[which][0]} rows, not {n} and {m}")  # fmt: skip
    if which is None or splits is None:
        processors = torch.cuda.get_device_properties(x.device).multi_processor_count
        which, splits = config(m, n, k, processors)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    sums, counters = _workspaces[x.device]
    stream = torch.cuda.current_stream(x.device).cuda_stream
    torch.ops.lmforge_cuda.int4_mma(
        x.contiguous(), words, sz, out, sums, counters, group, splits, which, stream
    )
    return out
