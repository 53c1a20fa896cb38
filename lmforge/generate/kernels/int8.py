"""int8 weights in the GEMV: their layout switches (`INT8_BIASED`, `INT8_OFFSET`), the
conversions `_gemv` runs on each tile (`_int8_values`: exact floats; `_int8_biased`: biased
floats, the bias taken off the whole product), both by byte permutes (ptx.py), and the int8
bytes as `QuantizedLinear` keeps them (`stored_int8`: q + 128 as uint8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.generate.kernels.ptx import (
    _INT8_BIASED_ASM,
    _INT8_BIASED_ASM_SIGNED,
    _INT8_VALUES_ASM,
    _INT8_VALUES_ASM_SIGNED,
    ASSEMBLY,
)

# int8 weights of one scale a row may be made floats 1 + (q + 128) / 2^15 by one byte permute
# each (`_int8_biased`), the bias taken off the whole product at the end with the sum of x: 1.25
# instructions a weight where `_int8_values` spends 2.25. Which one a product runs is tuned like
# its tile (`_candidates`): on an H200 (2026-12-02, docs/benchmarks.md) biased everywhere
# decoded the 1B 8.7% faster than exact, the 3B 2.7% slower. False: exact only (the A/B in
# benchmarks/decode.py, variant lmforge-int8-exact). Never for an fp32 model: its sums keep
# ~15 bits where the exact conversion keeps 24, visible in an fp32 output, not in a bf16 one.
INT8_BIASED = True

# `QuantizedLinear` keeps int8 weights as uint8 q + 128, the bytes `_int8_biased` and
# `_int8_values` set into floats' patterns: the xor that makes them (a quarter instruction a
# weight) is done once, at conversion. Compiled for sm_90 the 1B's int8 products take 4-5.5%
# fewer instructions (w13 1,296 SASS instructions a program instead of 1,360); on an H200
# (2026-12-03, docs/benchmarks.md) the 1B's int8 decoded 0.8% faster, the 3B's 1.3%. False:
# int8 as torchao stores it (the A/B in benchmarks/decode.py, variant lmforge-int8-signed).
INT8_OFFSET = True


@triton.jit
def _offset_bytes(q):
    """int8 q [rows, cols] as uint32 q + 128: from int8 one xor; uint8 holds q + 128 already
    (`QuantizedLinear`'s copy: the xor done once, when the weights are converted)."""
    if q.dtype == tl.uint8:
        return q.to(tl.uint32)
    return q.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x80


@triton.jit
def _int8_values(q):
    """int8 [rows, cols] (or uint8 q + 128: `_offset_bytes`) as exact fp32 without the
    integer-to-float converter (a quarter of the FMA rate): as bits, 2^23 + 128 + q is
    0x4B000000 | (q + 128). Four at a time from the register that holds them: a byte permute
    sets each q + 128 into 0x4B0000__, a subtraction leaves q; 2 instructions a weight (2.25
    with the xor that makes int8 bytes q + 128), where Triton's own code for the same
    arithmetic spent 3 (a byte extract, an xor, a subtraction). Compiled for sm_90, 1B w13's
    kernel with its norm went from 7.49 to 6.77 instructions a weight, w2's with SiLU·up from
    7.34 to 6.62 (SASS counted over a program's rows, with the xor; docs/benchmarks.md). The
    interpreter runs no PTX: there, the same in Triton."""
    if not ASSEMBLY:
        bits = _offset_bytes(q) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    return _permuted(q, _INT8_VALUES_ASM, _INT8_VALUES_ASM_SIGNED)


@triton.jit
def _int8_biased(q):
    """int8 [rows, cols] (or uint8 q + 128: `_offset_bytes`) as fp32 1 + (q + 128) / 2^15,
    exactly, from their bits: 0x3F80__00 with q + 128 in the second byte. Four at a time from
    the register that holds them: one byte permute each sets q + 128 into 1.0's pattern, 1
    instruction a weight (1.25 with the xor that makes int8 bytes q + 128). The product's sum
    takes the bias off at the end (`_gemv`): the terms carry ~2^8 times their size in x, so the
    fp32 sums keep ~15 of their 24 bits, to a bf16 output's 8. The interpreter runs no PTX:
    there, the same in Triton."""
    if not ASSEMBLY:
        return ((_offset_bytes(q) << 8) | 0x3F800000).to(tl.float32, bitcast=True)
    return _permuted(q, _INT8_BIASED_ASM, _INT8_BIASED_ASM_SIGNED)


@triton.jit
def _permuted(q, OFFSET_ASM: tl.constexpr, SIGNED_ASM: tl.constexpr):
    """fp32 from q's bytes, four a register, by `_int8_asm`'s PTX: OFFSET_ASM for uint8 q + 128,
    SIGNED_ASM (its xor first) for int8 q."""
    asm: tl.constexpr = OFFSET_ASM if q.dtype == tl.uint8 else SIGNED_ASM
    return tl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r", [q], dtype=tl.float32, is_pure=True, pack=4
    )


def int8_biased(bits: int, group: int, k: int, dtype: torch.dtype, weights: torch.dtype) -> bool:
    """Whether a product of x in `dtype` may take its int8 weights biased (`INT8_BIASED`; not
    float8 `weights`)."""
    eight_bit_integers = bits == 8 and not weights.is_floating_point
    return INT8_BIASED and eight_bit_integers and group == k and dtype != torch.float32


def stored_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, K] as `QuantizedLinear` keeps it: uint8 q + 128, the bytes the permutes take
    as they are (`INT8_OFFSET`), else int8 as torchao stores it."""
    return q.view(torch.uint8) ^ 0x80 if INT8_OFFSET else q
