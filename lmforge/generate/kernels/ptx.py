"""The inline PTX the GEMV kernels run on NVIDIA GPUs, built as strings here and explained where
each is built: `ASSEMBLY` (whether the kernels use it at all), `_int8_asm` (four int8 weights
made fp32 by byte permutes, for `int8.py`) and `_int4_asm` (four words of int4 nibbles times x
in packed fp16, for `int4.py`'s `_int4_words_times`). The kernels' two one-line PTX snippets
(`_int4_values`' shifts and LOP3s, `_half_pair`'s conversion) stay in their functions, whose
docstrings explain them. Under Triton's interpreter (the tests) no PTX runs: each caller has the
same arithmetic in Triton beside it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from lmforge.generate.early_launch import INTERPRETED

# inline PTX in the kernels (NVIDIA GPUs; not the interpreter, not ROCm)
ASSEMBLY = tl.constexpr(not INTERPRETED and torch.version.hip is None)


def _int8_asm(selectors: tuple[str, ...], subtract: str | None, signed: bool) -> str:
    """PTX making four fp32 $0-$3 from the four bytes q + 128 of $4 (`signed`: the bytes are
    int8 q; one xor makes all four q + 128), each set by a byte permute (its selector) into a
    float's pattern, then `subtract` taken off each (None: none)."""
    biased = "biased" if signed else "$4"
    lines = [".reg .b32 biased;", "xor.b32 biased, $4, 0x80808080;"] if signed else []
    pattern = "0x4B000000" if subtract else "0x3F800000"
    for i, selector in enumerate(selectors):
        lines.append(f"prmt.b32 ${i}, {biased}, {pattern}, {selector};")
    if subtract:
        lines += [f"sub.f32 ${i}, ${i}, {subtract};" for i in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


# `_int8_asm`'s selectors: `prmt.b32 d, a, b, sel` builds d byte by byte, each hex digit of sel
# (lowest first) naming one byte of the pair {b, a}: 0-3 are a's bytes (here the four weights,
# q + 128), 4-7 b's (here a float's pattern). 0x7540: weight byte 0, then the pattern's bytes 4,
# 5, 7 -> 0x4B0000__ (2^23 + 128 + q: the exact value after subtracting 2^23 + 128); 0x7541-3
# take weight bytes 1-3 the same way. 0x7604: the pattern's byte 4, weight byte 0, pattern bytes
# 6, 7 -> 0x3F80__00 (1 + (q + 128) / 2^15: `_int8_biased`, nothing subtracted).
_VALUES = ("0x7540", "0x7541", "0x7542", "0x7543"), "0f4B000080"  # into 0x4B0000__, - (2^23 + 128)
_INT8_VALUES_ASM = tl.constexpr(_int8_asm(*_VALUES, signed=False))
_INT8_VALUES_ASM_SIGNED = tl.constexpr(_int8_asm(*_VALUES, signed=True))
_BIASED = ("0x7604", "0x7614", "0x7624", "0x7634"), None  # into 0x3F80__00
_INT8_BIASED_ASM = tl.constexpr(_int8_asm(*_BIASED, signed=False))
_INT8_BIASED_ASM_SIGNED = tl.constexpr(_int8_asm(*_BIASED, signed=True))


def _int4_asm() -> str:
    """`_int4_words_times`' PTX: four words of a row within one group, $8-$11, with their x
    pairs $12-$27, scales $28 (low) and $32 (high), added to acc $4 (acc $5-$7 pass)."""
    lines = [
        ".reg .b32 w8, l02, l13, h02, h13, dl, dh, c1032, c16th, c72;",
        ".reg .b16 lo, hi;",
        ".reg .f32 flo, fhi, sum;",
        "mov.b32 c1032, 0x64086408;",  # 1032.0 twice: 1024 + n - 1032 = n - 8
        "mov.b32 c16th, 0x2C002C00;",  # 1/16 twice
        "mov.b32 c72, 0xD480D480;",  # -72.0 twice: (1024 + 16 n) / 16 - 72 = n - 8
        "mov.b32 dl, 0;",
        "mov.b32 dh, 0;",
    ]
    for i in range(4):  # word i of the four: its x pairs a, b (low nibbles), c, d (high)
        w, a, b, c, d = (f"${8 + 4 * j + i}" for j in range(5))
        lines += [
            f"shr.b32 w8, {w}, 8;",  # bytes 1 and 3 where bytes 0 and 2 were
            # Two nibbles a register, each in an fp16 lane: low ones 1024 + n, high 1024 + 16 n.
            f"lop3.b32 l02, {w}, 0x000F000F, 0x64006400, 0xEA;",  # (w & mask) | 1024.0's bits
            f"lop3.b32 h02, {w}, 0x00F000F0, 0x64006400, 0xEA;",
            "lop3.b32 l13, w8, 0x000F000F, 0x64006400, 0xEA;",
            "lop3.b32 h13, w8, 0x00F000F0, 0x64006400, 0xEA;",
            # Each lane to n - 8, exactly (fp16 holds every integer up to 2048).
            "sub.rn.f16x2 l02, l02, c1032;",
            "sub.rn.f16x2 l13, l13, c1032;",
            "fma.rn.f16x2 h02, h02, c16th, c72;",
            "fma.rn.f16x2 h13, h13, c16th, c72;",
            # (n - 8) x summed in two fp16 lanes, low nibbles in dl, high in dh.
            f"fma.rn.f16x2 dl, l02, {a}, dl;",
            f"fma.rn.f16x2 dl, l13, {b}, dl;",
            f"fma.rn.f16x2 dh, h02, {c}, dh;",
            f"fma.rn.f16x2 dh, h13, {d}, dh;",
        ]
    # Each lane pair to fp32, summed, times its group's scale: acc + low * scale_low, then that
    # + high * scale_high, in $0; the other packed slots pass their acc through.
    for lanes, scale, into in (("dl", "$28", "$4"), ("dh", "$32", "$0")):
        lines += [
            f"mov.b32 {{lo, hi}}, {lanes};",
            "cvt.f32.f16 flo, lo;",
            "cvt.f32.f16 fhi, hi;",
            "add.f32 sum, flo, fhi;",
            f"fma.rn.f32 $0, sum, {scale}, {into};",
        ]
    lines += ["mov.b32 $1, $5;", "mov.b32 $2, $6;", "mov.b32 $3, $7;"]
    return "{\n" + "\n".join(lines) + "\n}"


_INT4_ASM = tl.constexpr(_int4_asm())
_INT4_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 32))  # 4 out, 32 in
