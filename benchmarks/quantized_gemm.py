"""The block products of a preset at 1-64 rows: bf16 (cuBLAS, or the GEMV at one row) against
int8 and int4 in the engine's layout (`lmforge.generate.kernels`: the GEMV at one row,
`quantized_gemm` at 2-128), each timed alone with CUDA events (median of --repeats), and the
bandwidth each reaches (weight bytes / time), each product replayed in a CUDA graph. Fills docs/benchmarks.md's "Quantized" product
table (`bash benchmarks/device_calls.sh quantized-serve` runs it first).

    python3 benchmarks/quantized_gemm.py --preset llama3.2-1b --rows 1 8 32 64

--variants adds columns for `quantized_gemm.VARIANT`s (swap: the weight tile as the product's
left operand; fast: dequantized in bf16 arithmetic), for GemLite (pip gemlite, its Triton
A16W8 / A16W4 kernels, the peer docs/benchmarks.md compares with), for fbgemm-gpu-genai's CUTLASS
sm90 mixed-input products over int4 weights (`fbgemm`: preshuffled and plain, in --group) and for
W8A8 float8 (`fp8`: e4m3 weights with a scale a row, activations quantized a row at run time,
through `torch._scaled_mm`; `fp8-mm` the product alone, `fp8-fbgemm` fbgemm's own quantizer and
`f8f8bf16_rowwise`) and for lmforge's CUDA int4 product (`mma`: `int4_mma`, the launch
`config` picks, and the fastest of its configs and splits, printed). Each of those prints its error against the product of the weights it
dequantizes, ||y - ref|| / ||ref||, at the first row count.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch

from lmforge.generate.kernels import QuantizedLinear, dequantize, gemv
from lmforge.generate.kernels import quantized_gemm as tiled
from lmforge.generate.kernels.quantized_gemm import quantized_gemm
from lmforge.models import get_preset
from lmforge.quantize.stored import float8_rows

PROCESSORS = (
    torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0
)


def timed(fn, repeats: int, launches: int = 20) -> float:
    """Median milliseconds of one `fn()` on the GPU: `launches` of it recorded in a CUDA graph
    (as the engine runs them: no host time between kernels), the graph replayed `repeats`
    times. Timed eagerly, each launch measured the host's ~50 us of dispatch instead (a first
    run, 2026-12-04: every product 0.05-0.27 ms)."""
    for _ in range(3):  # autotuning and compilation happen here, outside the graph
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return statistics.median(times)


def quantized(weight: torch.Tensor, bits: int, group: int) -> QuantizedLinear:
    """Random values in the engine's layout for a weight [N, K] (the time does not depend on
    them)."""
    n, k = weight.shape
    if bits == 8:
        q = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=weight.device)
        return QuantizedLinear(q, torch.rand(n, 1, device=weight.device).bfloat16(),
                               torch.empty(n, 0, device=weight.device), 8)  # fmt: skip
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=weight.device)
    scale = torch.rand(n, k // group, device=weight.device).bfloat16()
    return QuantizedLinear(q, scale, torch.zeros_like(scale), 4)


def product(x, weight, layer, bits: int) -> torch.Tensor:
    """x @ w.T as the engine runs it: one row in the GEMV, more in cuBLAS (bf16) or
    `quantized_gemm`."""
    if bits == 16:
        return gemv(x, weight) if x.shape[0] == 1 else x @ weight.t()
    if x.shape[0] == 1:
        return layer(x)
    return quantized_gemm(x, layer.q, layer.scale, layer.zero, bits)


VARIANTS = {"plain": {"swap": False, "fast": False}, "swap": {"swap": True, "fast": False},
            "swap-fast": {"swap": True, "fast": True},
            "fast": {"swap": False, "fast": True}}  # fmt: skip


def variant_product(x, layer, bits: int, variant: dict) -> torch.Tensor:
    tiled.VARIANT.update(variant)
    try:
        return quantized_gemm(x, layer.q, layer.scale, layer.zero, bits)
    finally:
        tiled.VARIANT.update(swap=None, fast=None)


def gemlite_layer(n: int, k: int, bits: int, group: int):
    """GemLite's linear for a random [N, K] weight: int8 per row (A16W8_INT8), or int4 in
    groups with float zeros (HQQ's layout, A16W4_HQQ_INT)."""
    import gemlite.helper as helper

    if bits == 8:
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        return helper.A16W8_INT8(device="cuda", dtype=torch.bfloat16).from_linear(linear)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scale = torch.rand(n, k // group, device="cuda").bfloat16() * 1e-2
    zero = torch.full_like(scale, 8.0)
    return helper.A16W4_HQQ_INT(device="cuda", dtype=torch.bfloat16).from_weights(q, scale, zero)


def fbgemm_columns(weight: torch.Tensor, group: int) -> dict:
    """fbgemm-gpu-genai's int4 products of `weight` [N, K] (groups of `group`, zero points as
    the engine's int4: w = (q - 8) * scale + zero), name -> (fn(x), weight bytes, dequantized
    weight)."""
    from fbgemm_gpu.experimental.gen_ai.quantize import int4_row_quantize_zp, pack_int4

    q, scale, zero = int4_row_quantize_zp(weight, group)  # q - 8 [N, K]; scale, zero [K/g, N]
    scale, zero = scale.bfloat16(), zero.bfloat16()
    dequantized = (q.float().view(q.shape[0], -1, group) * scale.t()[..., None].float()
                   + zero.t()[..., None].float()).view_as(weight).bfloat16()  # fmt: skip
    packed = pack_int4(q)
    shuffled, shuffled_scale = torch.ops.fbgemm.preshuffle_i4(packed, scale)
    size = packed.numel() + scale.numel() * 4
    ops = torch.ops.fbgemm
    return {
        "i4-shuffled": (
            lambda x: ops.bf16i4bf16_shuffled(x, shuffled, shuffled_scale, zero),
            size,
            dequantized,
        ),
        "i4-rowwise": (lambda x: ops.bf16i4bf16_rowwise(x, packed, scale, zero), size, dequantized),
    }


def fp8_columns(weight: torch.Tensor) -> dict:
    """W8A8 float8 products of `weight` [N, K]: a scale a weight row, activations quantized a
    row at run time. name -> (fn(x), weight bytes, dequantized weight)."""
    wq, w_scale = float8_rows(weight)
    dequantized = (wq.float() * w_scale).bfloat16()
    size = wq.numel() + w_scale.numel() * 4
    w_scale_t = w_scale.t().contiguous()  # [1, N]

    def fp8(x):
        xq, x_scale = float8_rows(x)
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale_t,
                                out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip

    prequantized = {}

    def fp8_mm(x):  # the product alone, on activations quantized once outside the graph
        if x.data_ptr() not in prequantized:
            prequantized[x.data_ptr()] = float8_rows(x)
        xq, x_scale = prequantized[x.data_ptr()]
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale_t,
                                out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip

    columns = {"fp8": (fp8, size, dequantized), "fp8-mm": (fp8_mm, size, dequantized)}
    try:
        from fbgemm_gpu.experimental.gemm.triton_gemm.fp8_gemm import quantize_fp8_row
    except ImportError:
        return columns
    fq, f_scale = quantize_fp8_row(weight)

    def fp8_fbgemm(x):
        xq, x_scale = quantize_fp8_row(x)
        return torch.ops.fbgemm.f8f8bf16_rowwise(xq, fq, x_scale, f_scale, use_fast_accum=True)

    columns["fp8-fbgemm"] = (fp8_fbgemm, size, dequantized)
    return columns


def mma_columns(layer: QuantizedLinear, repeats: int) -> dict:
    """lmforge's CUDA int4 product of `layer` (random int4 values, scales and zeros): with the
    launch `config` picks, and the fastest of every config and split count for the rows."""
    from lmforge.generate.kernels import int4_mma

    reason = int4_mma.available()
    if reason is not None:
        raise RuntimeError(reason)
    layer.zero.uniform_(-0.01, 0.01)
    group = 2 * layer.q.shape[1] // layer.scale.shape[1]
    words, sz = int4_mma.pack(layer.q, layer.scale, layer.zero)
    int4_mma.reserve(layer.q.shape[0], layer.q.device)
    dequantized = dequantize(layer.q, layer.scale, layer.zero, 4, torch.bfloat16)
    size = layer.q.numel() + layer.scale.numel() * 4

    def best(x):  # the fastest launch for x's rows (printed), then that launch
        rows = x.shape[0]
        if rows not in picks:
            n = dequantized.shape[0]
            fits = [w for w, (tiles, columns, _) in int4_mma.CONFIGS.items()
                    if 16 * tiles >= rows and n % columns == 0]  # fmt: skip
            splits = [s for s in (1, 2, 3, 4, 6, 8, 12, 16) if s * rows <= int4_mma.MAX_SPLIT_ROWS]
            launches = [(w, s) for w in fits for s in splits]
            times = {c: timed(partial(int4_mma.int4_mma, x, words, sz, group, *c), repeats)
                     for c in launches}  # fmt: skip
            picks[rows] = min(times, key=times.get)
            auto = int4_mma.config(rows, *dequantized.shape, PROCESSORS)
            print(f"int4-mma rows {rows}: best (config, splits) {picks[rows]} "
                  f"{times[picks[rows]] * 1e3:.1f} us; config() {auto} {times.get(auto, 0) * 1e3:.1f} us")  # fmt: skip
        return int4_mma.int4_mma(x, words, sz, group, *picks[rows])

    picks: dict[int, tuple[int, int]] = {}
    return {
        "int4-mma": (lambda x: int4_mma.int4_mma(x, words, sz, group), size, dequantized),
        "int4-mma-best": (best, size, dequantized),
    }


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--group", type=int, default=256, help="int4 group size (256)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--variants", nargs="*", default=[],
                        choices=[*VARIANTS, "gemlite", "fbgemm", "fp8", "mma"])  # fmt: skip
    parser.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4],
                        help="lmforge's own columns: 16 (bf16), 8, 4")  # fmt: skip
    parser.add_argument("--products", nargs="*", default=["wqkv", "wo", "w13", "w2"])
    args = parser.parse_args()
    model = get_preset(args.preset)
    shapes = {  # the fused products of a block: (N, K)
        "wqkv": ((model.num_heads + 2 * model.num_kv_heads) * model.head_dim, model.dim),
        "wo": (model.dim, model.num_heads * model.head_dim),
        "w13": (2 * model.ffn_dim, model.dim),
        "w2": (model.dim, model.ffn_dim),
    }
    print(f"{args.preset}: ms a product (GB/s of its weight bytes); int4 group {args.group}")
    tiled_variants = [v for v in args.variants if v in VARIANTS or v == "gemlite"]
    extra = [f"{b}-{v}" for v in tiled_variants for b in ("int8", "int4")]
    peer_names = {"fbgemm": ["i4-shuffled", "i4-rowwise"], "fp8": ["fp8", "fp8-mm", "fp8-fbgemm"],
                  "mma": ["int4-mma", "int4-mma-best"]}  # fmt: skip
    named = [c for v in args.variants for c in peer_names.get(v, [])]
    own = {16: "bf16", 8: "int8", 4: "int4"}
    header = [own[b] for b in args.bits] + extra + named
    print(f"{'product':>8} {'rows':>5} " + " ".join(f"{c:>16}" for c in header))
    for name, (n, k) in shapes.items():
        if name not in args.products:
            continue
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        layers = {8: quantized(weight, 8, args.group), 4: quantized(weight, 4, args.group)}
        peers = (
            {b: gemlite_layer(n, k, b, args.group) for b in (8, 4)}
            if "gemlite" in args.variants
            else {}
        )
        columns = {}
        if "fbgemm" in args.variants:
            columns.update(peer_columns(partial(fbgemm_columns, weight, args.group)))
        if "fp8" in args.variants:
            columns.update(peer_columns(partial(fp8_columns, weight)))
        if "mma" in args.variants:
            columns.update(peer_columns(partial(mma_columns, layers[4], args.repeats)))
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cells = []
            for bits in args.bits:
                layer = layers.get(bits)
                fn = partial(product, x, weight, layer, bits)
                if bits == 16:
                    size = weight.numel() * 2
                else:
                    size = layer.q.numel() + layer.scale.numel() * 2 * (2 if bits == 4 else 1)
                cells.append(timed_cell(fn, size, args.repeats, f"int{bits} rows {rows}"))
            for variant in tiled_variants:
                for bits in (8, 4):
                    layer = layers[bits]
                    size = layer.q.numel() + layer.scale.numel() * 2 * (2 if bits == 4 else 1)
                    if variant == "gemlite":
                        fn = partial(peers[bits], x)
                    elif rows == 1:
                        cells.append("-")
                        continue
                    else:
                        fn = partial(variant_product, x, layer, bits, VARIANTS[variant])
                    cells.append(timed_cell(fn, size, args.repeats, f"{variant} int{bits}"))
            for column in named:
                if column not in columns:
                    cells.append("missing")
                    continue
                fn, size, dequantized = columns[column]
                if rows == args.rows[0]:
                    try:
                        error = relative_error(fn(x), x @ dequantized.t())
                        print(f"{name} {column}: relative error {error:.2e}", flush=True)
                    except Exception as failure:
                        print(f"{name} {column}: {type(failure).__name__}: {failure}"[:300])
                cells.append(timed_cell(partial(fn, x), size, args.repeats, column))
            print(f"{name:>8} {rows:>5} " + " ".join(f"{c:>16}" for c in cells), flush=True)


def peer_columns(build) -> dict:
    """A peer's columns, or none (with the reason printed) where it cannot be built here."""
    try:
        return build()
    except Exception as error:
        print(f"{build.func.__name__}: {type(error).__name__}: {error}"[:300], flush=True)
        return {}


def timed_cell(fn, size: int, repeats: int, what: str) -> str:
    """'ms (GB/s)' of fn, or the error's name (a peer's failure is a cell, not the table's end)."""
    try:
        ms = timed(fn, repeats)
    except Exception as error:
        why = str(error.__cause__ or error).splitlines()[-1:]
        print(f"{what}: {why}", flush=True)
        return type(error).__name__
    return f"{ms:.4f} ({size / ms / 1e6:,.0f})"


if __name__ == "__main__":
    main()
