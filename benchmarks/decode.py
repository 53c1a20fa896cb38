"""Batch-1 decode speed on one GPU (or the CPU): lmforge's `Generator` (static KV cache, decode
step compiled with CUDA graphs on a GPU) side by side with Hugging Face transformers' `generate`
on the same weights, against the memory-bandwidth limit.

For each preset (random weights, bf16): lmforge's decode tokens/s (prefill excluded) and overall
tokens/s; transformers' `generate` on the same weights exported with `lmforge.save` and loaded
with `LlamaForCausalLM.from_pretrained(..., dtype=torch.bfloat16)`, greedy, with its default
dynamic cache ("hf") and its static cache ("hf-static", which transformers compiles itself);
the bandwidth limit = measured device copy bandwidth / weight bytes read per token, and each
row's % of it. DESIGN's target: lmforge bf16 >= 70% of the limit.

    python benchmarks/decode.py                                  # 1B and 3B, all variants
    python benchmarks/decode.py --presets llama3.2-1b --variants lmforge hf-static
    python benchmarks/decode.py --schemes bf16 int8-wo int4-wo
    python benchmarks/decode.py --device cpu --presets tiny --schemes fp32 --variants lmforge

Each variant compiles first (about a minute for lmforge and for hf-static); with a 10-minute
limit per command, run one preset per command. Writes decode.json to --out ($OUT if set).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from lmforge.api import build_model, save_state
from lmforge.generate import Generator, SamplingParams, early_launch
from lmforge.generate import engine as engine_module
from lmforge.generate.engine import use_quantized_kernels
from lmforge.generate.generate import weight_bytes
from lmforge.generate.kernels import fused_block, gemv_kernel, int4, int8, tiles
from lmforge.models.llama import get_preset


# Weight schemes for lmforge rows. Hook for the quantize work: add "int8-wo" and "int4-wo" here,
# each a function taking the bf16 model (on the GPU) and returning it with quantized linear
# weights (through lmforge's quantize module). `weight_bytes` counts a tensor subclass's packed
# data and scales, so each row's bandwidth limit follows its own bytes.
def _quantized(
    scheme: str, group_size: int | None, *, output: bool = False
) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        from lmforge.quantize.quantize import QuantSpec, quantize_model

        spec = QuantSpec(scheme, group_size=group_size, quantize_output=output)
        quantize_model(model, spec)
        return model

    return apply


def _gemlite(bit_width: int, group_size: int | None) -> Callable[[nn.Module], nn.Module]:
    """torchao's gemlite layout (`UIntxWeightOnlyConfig`: bit-packed weights, gemlite's Triton
    GEMV/GEMM kernels), tried here before lmforge's quantize stage offers it: tinygemm int4
    reads ~1 TB/s at batch 1 on an H200. Needs the gemlite package (benchmarks/device_wheels.sh).
    int4 runs in float16: gemlite 0.5.1's 4-bit kernel keeps float16 scales and fails to compile
    with bfloat16 activations (`tl.dot` of bf16 and fp16; H200, 2026-12-01)."""

    def apply(model: nn.Module) -> nn.Module:
        from torchao.prototype.quantization import UIntxWeightOnlyConfig
        from torchao.quantization import quantize_

        from lmforge.quantize.quantize import quantized_module_names

        if bit_width == 4:
            model = model.half()

        chosen = set(quantized_module_names(model.args, quantize_output=False))
        config = UIntxWeightOnlyConfig(group_size=group_size, bit_width=bit_width)
        quantize_(model, config, filter_fn=lambda module, fqn: fqn in chosen)
        return model

    return apply


def _mslk(scheme: str) -> Callable[[nn.Module], nn.Module]:
    """torchao's preshuffled int4 layout (`Int4PreshuffledTensor`: MSLK's CUTLASS kernels for
    Hopper, bf16 activations with int4 weights, or float8 activations with int4 weights), tried
    here before lmforge's quantize stage offers it. Needs the mslk-cuda package (the kernels
    formerly in fbgemm-gpu-genai), which the device image lacks."""

    def apply(model: nn.Module) -> nn.Module:
        from torchao.quantization import (
            Float8DynamicActivationInt4WeightConfig,
            Int4WeightOnlyConfig,
            quantize_,
        )

        from lmforge.quantize.quantize import quantized_module_names

        chosen = set(quantized_module_names(model.args, quantize_output=False))
        if scheme == "int4-preshuffled":
            config = Int4WeightOnlyConfig(group_size=128, int4_packing_format="preshuffled")
        else:
            config = Float8DynamicActivationInt4WeightConfig()
        quantize_(model, config, filter_fn=lambda module, fqn: fqn in chosen)
        return model

    return apply


SCHEMES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "bf16": lambda model: model,
    "fp32": lambda model: model.float(),  # CPUs without fast bf16 matmuls
    "int8-wo": _quantized("int8-wo", None),
    # the output projection quantized too (`quantize.quantize_output`; a tied one gets its own
    # copy, the embedding stays bf16): int8 is then read for 128k x dim more weights a token
    "int8-wo-output": _quantized("int8-wo", None, output=True),
    "int4-wo": _quantized("int4-wo", 128),
    "int4-wo-output": _quantized("int4-wo", 128, output=True),
    "int4-gemlite": _gemlite(4, 128),
    "int8-gemlite": _gemlite(8, None),
    "int4-preshuffled": _mslk("int4-preshuffled"),
    "fp8-int4": _mslk("fp8-int4"),
}

VARIANTS = (
    "lmforge",
    "lmforge-unfused",
    "lmforge-untuned",
    "lmforge-autotune",
    "lmforge-eager",
    "lmforge-torchao",  # quantized linears through torchao's kernels, not lmforge's
    "lmforge-inductor",  # plain weights' batch-1 products as inductor's reductions, no GEMV
    "lmforge-unfused-blocks",  # the GEMVs without the norms, SiLU·up and residual adds inside
    "lmforge-no-early",  # the step's kernels launched only after the one before has finished
    "lmforge-no-preload",  # launched early, but nothing is read before a kernel's wait
    "lmforge-preload-1",  # launched early, the GEMV loading one weight tile before its wait
    "lmforge-preload-2",  # ... two tiles (the engine: by the weight's bits, gemv_kernel.PRELOAD)
    "lmforge-int4-bytes",  # int4 through `_gemv`'s bytes, not the packed fp16 kernel
    "lmforge-swiglu-in-w2",  # SiLU·up made by each of w2's programs, not once by w13's
    "lmforge-no-split",  # no product's rows split among programs (tiles.SPLIT_K)
    "lmforge-int4-converter",  # ... its nibbles floats by the converter, not from their bits
    "lmforge-int8-exact",  # int8 made exact floats, not biased ones (int8.INT8_BIASED)
    "lmforge-int8-signed",  # int8 bytes as torchao keeps them, not q + 128 (int8.INT8_OFFSET)
    "lmforge-host-argmax",  # greedy tokens chosen after the step's graph (engine.GREEDY_IN_GRAPH)
    "hf",
    "hf-static",
)
DEFAULT_VARIANTS = ("lmforge", "hf", "hf-static")
UNFUSED_BLOCKS = ("lmforge-inductor", "lmforge-unfused-blocks")
DEVICE = "cuda"  # --device


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(num_bytes: int = 4 << 30, iterations: int = 20) -> float:
    """Copy bandwidth of the device in bytes/s, counting each byte read and written."""
    if DEVICE == "cpu":
        num_bytes, iterations = num_bytes // 8, iterations // 4
    source = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    _sync()
    start = time.perf_counter()
    for _ in range(iterations):
        target.copy_(source)
    _sync()
    seconds = time.perf_counter() - start
    del source, target
    _cleanup()
    return 2 * num_bytes * iterations / seconds


@contextlib.contextmanager
def launch_context(variant: str):
    """The kernels' launch for `variant`: `...no-early` launches each after the one before has
    finished; `...no-preload` early, without the GEMV's first weight tiles loaded before its
    wait; `...preload-1` / `...preload-2` with one / two GEMV tiles at every width (the engine:
    `gemv_kernel.PRELOAD`); `...int4-bytes` runs int4 through `_gemv`'s bytes, not the packed fp16
    kernel (`int4.INT4_HALVES`), `...swiglu-in-w2` makes SiLU·up in each of w2's programs,
    not once after w13's products (`fused_block.SWIGLU_IN_W13`), `...no-split` shares no row among
    programs (`tiles.SPLIT_K`), `...int4-converter` runs `_gemv`'s bytes too, its nibbles
    floats by the converter, not from their bit patterns (`gemv_kernel.INT4_FROM_BITS`);
    `...int8-exact` int8 weights exact floats, not biased ones (`int8.INT8_BIASED`);
    `...int8-signed` int8 bytes as torchao stores them, not q + 128 (`int8.INT8_OFFSET`);
    `...host-argmax` greedy tokens chosen after the step's CUDA graph, not inside it
    (`engine.GREEDY_IN_GRAPH`). The
    GEMV's tiles are tuned once a shape and kept (Triton's cache directory; pinned ones:
    `tiles.TILES`), so every variant runs the first one's tiles."""
    saved = early_launch.ENABLED, gemv_kernel.PRELOAD, gemv_kernel.INT4_FROM_BITS, int8.INT8_BIASED
    halves, swiglu, split = int4.INT4_HALVES, fused_block.SWIGLU_IN_W13, tiles.SPLIT_K
    in_graph, offset = engine_module.GREEDY_IN_GRAPH, int8.INT8_OFFSET
    int8.INT8_OFFSET = offset and not variant.endswith("int8-signed")
    engine_module.GREEDY_IN_GRAPH = in_graph and not variant.endswith("host-argmax")
    int4.INT4_HALVES = halves and not variant.endswith(("int4-bytes", "int4-converter"))
    fused_block.SWIGLU_IN_W13 = swiglu and not variant.endswith("swiglu-in-w2")
    tiles.SPLIT_K = split and not variant.endswith("no-split")
    gemv_kernel.INT4_FROM_BITS = saved[2] and not variant.endswith("int4-converter")
    int8.INT8_BIASED = saved[3] and not variant.endswith("int8-exact")
    early_launch.ENABLED = not variant.endswith("no-early")
    if variant.endswith(("no-early", "no-preload")):
        gemv_kernel.PRELOAD = dict.fromkeys(saved[1], 0)
    elif variant.endswith(("preload-1", "preload-2")):
        gemv_kernel.PRELOAD = dict.fromkeys(saved[1], int(variant[-1]))
    try:
        yield
    finally:
        early_launch.ENABLED, gemv_kernel.PRELOAD, gemv_kernel.INT4_FROM_BITS, int8.INT8_BIASED = (
            saved
        )
        int4.INT4_HALVES, fused_block.SWIGLU_IN_W13, tiles.SPLIT_K = halves, swiglu, split
        engine_module.GREEDY_IN_GRAPH, int8.INT8_OFFSET = in_graph, offset


def _peak_gb() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if DEVICE == "cuda" else None


def make_model(preset: str, scheme: str) -> nn.Module:
    model = build_model(get_preset(preset), device=DEVICE, dtype=torch.bfloat16, seed=0)
    return SCHEMES[scheme](model.eval())


def bench_lmforge(
    model,
    prompt: list[int],
    new_tokens: int,
    repeats: int,
    *,
    compile: bool,
    fuse: bool = True,
    tune: bool = True,
    autotune: bool = False,
    kernels: bool = True,
    gemv: bool = True,
    fuse_blocks: bool = True,
):
    generator = Generator(
        model,
        max_batch=1,
        max_seq_len=len(prompt) + new_tokens,
        device=DEVICE,
        compile=compile,
        fuse=fuse,
        tune_decode=tune,
        quantized_kernels=kernels,
        gemv=gemv,
        fuse_blocks=fuse_blocks,
    )
    if autotune:  # inductor's max-autotune for the decode compiles (benchmarks.decode_profile)
        from benchmarks.common import autotuned

        with autotuned():
            generator.warmup()
    else:
        generator.warmup()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_token_ids=())
    generator.generate([prompt], params)  # one untimed run: allocator, first prefill shape
    runs = [generator.generate([prompt], params) for _ in range(repeats)]
    tokens = runs[-1].results[0].token_ids
    assert len(tokens) == new_tokens, len(tokens)
    decode = statistics.median(r.stats.decode_tokens_per_s for r in runs)
    overall = statistics.median(r.stats.tokens_per_s for r in runs)
    return decode, overall, tokens


def bench_hf(directory: Path, prompt: list[int], new_tokens: int, repeats: int, *, static: bool):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model = model.to(DEVICE).eval()
    model.generation_config.eos_token_id = None  # always new_tokens tokens
    input_ids = torch.tensor([prompt], device=DEVICE)
    kwargs = dict(
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    if static:
        kwargs["cache_implementation"] = "static"

    def run():
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, **kwargs)
        _sync()
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()

    for _ in range(2 if static else 1):  # static: transformers compiles on the first calls
        run()
    runs = [run() for _ in range(repeats)]
    tokens = runs[-1][1]
    assert len(tokens) == new_tokens, len(tokens)
    overall = statistics.median(new_tokens / seconds for seconds, _ in runs)
    return overall, tokens


def _agreement(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference (bf16 kernels differ: near-ties may flip)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _cleanup() -> None:
    gc.collect()
    torch._dynamo.reset()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["llama3.2-1b", "llama3.2-3b"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    parser.add_argument(
        "--schemes",
        nargs="+",
        choices=sorted(SCHEMES),
        default=["bf16"],
        help="weight schemes for the lmforge rows (hf rows are always bf16)",
    )
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is kept")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where decode.json goes")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (--device cpu measures the CPU)")

    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = []

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)

    for preset in args.presets:
        model_args = get_preset(preset)
        prompt = torch.randint(
            0, model_args.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        bf16_bytes = None
        reference = None  # lmforge bf16 tokens, to compare with transformers'
        for scheme in args.schemes:
            for variant in [v for v in args.variants if v.startswith("lmforge")]:
                if variant == "lmforge-unfused" and scheme not in ("bf16", "fp32"):
                    continue  # only plain weights fuse
                if variant == "lmforge-torchao" and scheme not in ("int4-wo",):
                    continue  # nothing quantized; torchao's int8 is far behind (~900 tok/s, 1B)
                if variant == "lmforge-unfused-blocks" and scheme not in ("bf16", "fp32"):
                    continue  # the A/B of fusing blocks (quantized blocks fuse alike)
                if variant == "lmforge-inductor" and scheme not in ("bf16", "fp32"):
                    continue  # the bf16 comparison
                if variant.startswith("lmforge-int4") and scheme != "int4-wo":
                    continue
                if variant.startswith("lmforge-int8") and not scheme.startswith("int8"):
                    continue
                row = {"preset": preset, "variant": f"{variant} {scheme}"}
                try:
                    model = make_model(preset, scheme)
                    if variant.startswith("lmforge-int4"):  # tinygemm's int4 for `_gemv` too
                        use_quantized_kernels(model, torch.device(DEVICE), tinygemm=True)
                    num_bytes = weight_bytes(model)
                    with launch_context(variant):
                        decode, overall, tokens = bench_lmforge(
                            model,
                            prompt,
                            args.new_tokens,
                            args.repeats,
                            compile=variant != "lmforge-eager" and DEVICE == "cuda",
                            fuse=variant != "lmforge-unfused",
                            tune=variant != "lmforge-untuned",
                            autotune=variant == "lmforge-autotune",
                            kernels=variant != "lmforge-torchao",
                            gemv=variant != "lmforge-inductor",
                            fuse_blocks=variant not in UNFUSED_BLOCKS,
                        )
                    if scheme == "bf16":
                        if reference is not None:  # another bf16 variant: same tokens?
                            row["same_tokens_as_first"] = _agreement(reference, tokens)
                        bf16_bytes, reference = num_bytes, reference or tokens
                    limit = bandwidth / num_bytes
                    row.update(
                        weight_gb=round(num_bytes / 1e9, 3),
                        limit_tok_s=round(limit),
                        decode_tok_s=round(decode, 1),
                        overall_tok_s=round(overall, 1),
                        pct_of_limit=round(100 * decode / limit, 1),
                        bandwidth_gb_s=round(decode * num_bytes / 1e9),
                        peak_mem_gb=_peak_gb(),
                    )
                except Exception as err:  # one failing variant must not lose the others
                    traceback.print_exc()
                    row["error"] = f"{type(err).__name__}: {err}"[:300]
                record(row)
                model = None
                _cleanup()

        hf_variants = [v for v in args.variants if v.startswith("hf")]
        if not hf_variants:
            continue
        with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
            model = make_model(preset, "bf16")
            bf16_bytes = bf16_bytes or weight_bytes(model)
            state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
            directory = Path(tmp) / "model"
            save_state(state, model_args, None, directory, stage="benchmark", parent=None)
            del model, state
            _cleanup()
            for variant in hf_variants:
                row = {"preset": preset, "variant": f"{variant} bf16"}
                try:
                    overall, tokens = bench_hf(
                        directory,
                        prompt,
                        args.new_tokens,
                        args.repeats,
                        static=variant == "hf-static",
                    )
                    limit = bandwidth / bf16_bytes
                    row.update(
                        weight_gb=round(bf16_bytes / 1e9, 3),
                        limit_tok_s=round(limit),
                        overall_tok_s=round(overall, 1),
                        pct_of_limit=round(100 * overall / limit, 1),
                        bandwidth_gb_s=round(overall * bf16_bytes / 1e9),
                        peak_mem_gb=_peak_gb(),
                    )
                    if reference is not None:
                        row["same_tokens_as_lmforge"] = _agreement(reference, tokens)
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {err}"[:300]
                record(row)
                _cleanup()

    summary = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(os.path.join(args.out, "decode.json"), "w") as handle:
        json.dump(summary, handle, indent=1)

    print(
        f"\nbatch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens; copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s; decode = prefill excluded, overall = included"
    )
    header = (
        f"{'preset':13s} {'variant':26s} {'weights':>8s} {'limit':>7s} {'decode':>8s} "
        f"{'overall':>8s} {'% limit':>8s} {'GB/s':>6s} {'peak GB':>8s}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if "error" in row:
            print(f"{row['preset']:13s} {row['variant']:26s} FAILED {row['error'][:60]}")
            continue
        decode = f"{row['decode_tok_s']:8.0f}" if "decode_tok_s" in row else f"{'-':>8s}"
        peak = f"{row['peak_mem_gb']:8.2f}" if row["peak_mem_gb"] is not None else f"{'-':>8s}"
        print(
            f"{row['preset']:13s} {row['variant']:26s} {row['weight_gb']:6.2f}GB "
            f"{row['limit_tok_s']:7d} {decode} {row['overall_tok_s']:8.0f} "
            f"{row['pct_of_limit']:7.1f}% {row['bandwidth_gb_s']:6d} {peak}"
        )
    print(
        "(tokens/s; % limit uses decode for lmforge, overall for hf; target: lmforge bf16 >= 70%)"
    )


if __name__ == "__main__":
    main()
