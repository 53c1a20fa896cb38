"""Matrix-vector products for batch-1 decoding on CUDA, written in Triton, and the layers that
use them: a package by job (each module's docstring says what it owns).

A batch-1 decode step reads every weight once for a handful of multiply-adds per byte, so it
runs as fast as the weights stream from memory. Measured on an H200 one product at a time
(benchmarks/gemv.py, docs/benchmarks.md), `_gemv` reads the 1B's bf16 weights at 3.0-3.9 TB/s
where inductor's tuned reductions (what the compiled step made of them before) read them at
2.4-3.5 TB/s (the output projection: 134 against 201 us), and the 1B decodes 19% faster, the 3B
26%. `_gemv` keeps a [BLOCK_N, BLOCK_K] fp32 accumulator over the whole row and reduces it once
at the end, so its loop is loads, conversions and fused multiply-adds only.

Layouts (`bits`): 16: the weight as it is; 8: int8 q [N, K], or uint8 q + 128 as `QuantizedLinear`
keeps it (the bytes the kernels' byte permutes read); 4: uint8 [N, K/2], byte j of a row holding
q[j] in its low and q[j + K/2] in its high nibble (so a tile reads two contiguous runs of x). A
quantized weight is w = q * scale (int8, symmetric) or (q - 8) * scale + zero (int4, tinygemm's
convention), scale and zero [N, K / group]. With 2-128 rows of activations (batched decoding),
a quantized weight is dequantized tile by tile inside a tensor-core product (`quantized_gemm`);
with more (prefill), it is expanded to bf16 by `_dequantize` and multiplied by cuBLAS. Which
weights come here (`quantized_values`): int8, the int4 made on the CPU, and tinygemm's int4
(made on CUDA), converted once at load: at one row bf16-activation int4 runs in packed fp16
(`_gemv_int4`; on an H200 the 1B decoded 1.32-1.36x faster than on tinygemm, the 3B
1.27-1.29x, docs/benchmarks.md).

A single-row product can take the decode block's work around it into the same kernel: the
RMSNorm of its input, SiLU·up, a residual add (`gemv`'s arguments, `FusedDecodeBlock`). One
without a norm or SiLU·up may share each row among 2 or 4 programs (split-K, `_combine`).

The ops are registered with torch.library, so torch.compile treats them as opaque kernels and
a CUDA graph records them. Under TRITON_INTERPRET=1 they run on the CPU (the tests).

Modules: `gemv_kernel` (`_gemv`: plain, int8 and int4-byte weights, and its launch), `int8` and
`int4` (each width's conversions and switches; int4's packed-fp16 kernel `_gemv_int4`), `ptx`
(the inline PTX strings, explained where built), `shared` (what both kernels share), `tiles`
(tile shapes, autotuning, the pinned-tile table gemv_tiles.json), `ops` (the torch.library ops),
`layers` (`GemvLinear`, `QuantizedLinear` and the swaps), `fused_block` (`FusedDecodeBlock`),
`quantized_gemm` (products of 2-128 rows with int8/int4 weights), `int4_mma` (int4 products
of 2-64 rows in a CUDA kernel of our own, cuda/int4_mma.cu, built at first use), `moe` (a Mixture-of-Experts
block's experts for a few tokens in two kernels that read only the chosen experts:
`fused_experts`, `FusedExperts`, `use_fused_experts`).
A switch (`INT8_BIASED`, `SPLIT_K`, ...) lives in the module that reads it, and is set there
(benchmarks/decode.py's variants, the tests): this package re-exports functions and classes,
and `INTERPRETED` (a fact of the process, never set), but no switch.
"""

from lmforge.generate.early_launch import INTERPRETED
from lmforge.generate.kernels.fused_block import FusedDecodeBlock, use_fused_blocks
from lmforge.generate.kernels.layers import (
    Float8Linear,
    GemvLinear,
    QuantizedLinear,
    quantized_values,
    use_gemv,
    use_int4_mma,
    use_quantized_kernels,
)
from lmforge.generate.kernels.moe import FusedExperts, fused_experts, use_fused_experts
from lmforge.generate.kernels.ops import dequantize, gemv, one_row, quantized_matmul

__all__ = [
    "INTERPRETED",
    "Float8Linear",
    "FusedDecodeBlock",
    "FusedExperts",
    "GemvLinear",
    "QuantizedLinear",
    "dequantize",
    "fused_experts",
    "gemv",
    "one_row",
    "quantized_matmul",
    "quantized_values",
    "use_fused_blocks",
    "use_fused_experts",
    "use_gemv",
    "use_int4_mma",
    "use_quantized_kernels",
]
