"""Batch-1 decode speed on one GPU (or the CPU): lmforge's `Generator` (static KV cache, decode
step compiled with CUDA graphs on a GPU) side by side with Hugging Face transformers' `generate`
on the same weights, against the memory-bandwidth limit.

Fills docs/benchmarks.md's "Decode" table and the quantized decode rows of its "Quantized"
section (`bash benchmarks/device_calls.sh decode`). The limit = device copy bandwidth / weight
bytes read a token (a Mixture-of-Experts: the k experts a token chooses); one preset a command
(each variant compiles for about a minute).

    python benchmarks/decode.py --device cpu --presets tiny --schemes fp32 --variants lmforge
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks.common import cleanup, write_json
from lmforge.api import build_model, save_state
from lmforge.generate import Generator, SamplingParams
from lmforge.generate.generate import weight_bytes
from lmforge.models import get_preset
from lmforge.models.moe import MoEFeedForward, QuantizedExperts
from lmforge.quantize.stored import pack_int4


# Weight schemes for lmforge rows: the bf16 model with its linears quantized as `lmforge
# quantize` does; `weight_bytes` counts packed data and scales (each row's limit its own bytes).
def _quantized(scheme: str, group_size: int | None, *, output: bool = False):
    def apply(model: nn.Module) -> nn.Module:
        from lmforge.quantize.quantize import QuantSpec, quantize_model

        quantize_model(model, QuantSpec(scheme, group_size=group_size, quantize_output=output))
        return model

    return apply


def _fp8(model: nn.Module) -> nn.Module:
    """`lmforge quantize --scheme fp8`'s weights (W8A8) on every block linear, as `lmforge.load`
    holds them (torchao's Float8Tensor; the engine makes them its `Float8Linear`)."""
    from lmforge.quantize.stored import float8_weight

    for name, module in model.layers.named_modules():
        if type(module) is nn.Linear and module.bias is None and "router" not in name:
            module.weight = nn.Parameter(float8_weight(module.weight.data), requires_grad=False)
    return model


def _quantized_experts(bits: int, group: int | None):
    """A MoE's experts as lmforge loads a compressed-tensors artifact's (`QuantizedExperts`):
    symmetric, int8 with a scale a row (group None) or int4 two a byte with a scale per `group`
    columns; attention, router and the rest stay bf16."""

    def quantized(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cols = stack.shape[-1]
        grouped = stack.float().unflatten(-1, (-1, group or cols))  # [E, rows, groups, group]
        top = 2 ** (bits - 1) - 1
        scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-8) / top
        values = (grouped / scale).round().clamp(-top - 1, top).to(torch.int8).flatten(-2)
        values = pack_int4(values) if bits == 4 else values
        return values, scale.squeeze(-1).to(stack.dtype)

    def apply(model: nn.Module) -> nn.Module:
        for mlp in model.modules():
            if isinstance(mlp, MoEFeedForward):
                w13, w2 = mlp.experts.w13.data, mlp.experts.w2.data
                mlp.experts = QuantizedExperts(*quantized(w13), *quantized(w2))
                del w13, w2
        cleanup()
        return model

    return apply


def _mxfp4_experts(model: nn.Module) -> nn.Module:
    """gpt-oss's experts as `generate` / `serve` keep its hub's MXFP4 (`QuantizedExperts`: e2m1
    two a byte, a power-of-two scale byte a group of 32): random values at about the bf16
    weights' scale (a decode's speed does not depend on them), biases kept."""
    for mlp in model.modules():
        if isinstance(mlp, MoEFeedForward):
            stacks = []
            for stack in (mlp.experts.w13.data, mlp.experts.w2.data):
                generator = torch.Generator(device=stack.device).manual_seed(0)
                values = torch.randint(0, 256, (*stack.shape[:-1], stack.shape[-1] // 2),
                                       dtype=torch.uint8, device=stack.device, generator=generator)  # fmt: skip
                scales = torch.full((*stack.shape[:-1], stack.shape[-1] // 32), 119,
                                    dtype=torch.uint8, device=stack.device)  # fmt: skip
                stacks += [values, scales]
            biases = mlp.experts.biases() if hasattr(mlp.experts, "biases") else None
            mlp.experts = QuantizedExperts(*stacks, biases=biases)
    cleanup()
    return model


SCHEMES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "fp8": _fp8,
    "bf16": lambda model: model,
    "fp32": lambda model: model.float(),  # CPUs without fast bf16 matmuls
    "int8-wo": _quantized("int8-wo", None),
    # the output projection quantized too (a tied one gets its own copy; the embedding stays bf16)
    "int8-wo-output": _quantized("int8-wo", None, output=True),
    # int4 in `lmforge quantize`'s default group (256): 1.09x group 128's rate on the 8B
    # (2026-12-05, both tuned), what users run; the tile table pinned 128's for the 1B and 3B
    "int4-wo": _quantized("int4-wo", None),
    "int4-wo-output": _quantized("int4-wo", None, output=True),
    "int4-wo-g128": _quantized("int4-wo", 128),
    # a MoE's experts only (compressed-tensors W8A16 / W4A16 as lmforge holds them)
    "int8-experts": _quantized_experts(8, None),
    "int4-experts": _quantized_experts(4, 128),
    "mxfp4-experts": _mxfp4_experts,  # gpt-oss's hub format, kept
}

VARIANTS = ("lmforge", "hf-static")
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
    cleanup()
    return 2 * num_bytes * iterations / seconds


NUM_LAYERS: int | None = None  # --num-layers: a preset shortened (a large MoE on one GPU)


def preset_args(preset: str):
    args = get_preset(preset)
    return args.replace(num_layers=NUM_LAYERS) if NUM_LAYERS else args


def make_model(preset: str, scheme: str) -> nn.Module:
    model = build_model(preset_args(preset), device=DEVICE, dtype=torch.bfloat16, seed=0)
    return SCHEMES[scheme](model.eval())


def bench_lmforge(preset: str, prompt: list[int], scheme: str, args) -> tuple[float, float, int]:
    """lmforge's decode and overall tokens/s on `scheme`'s weights, and their bytes."""
    model = make_model(preset, scheme)
    num_bytes = weight_bytes(model)  # as quantized, before the engine converts it
    generator = Generator(model, max_batch=1, max_seq_len=len(prompt) + args.new_tokens,
                          device=DEVICE, compile=DEVICE == "cuda")  # fmt: skip
    generator.warmup()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0, stop_token_ids=())
    generator.generate([prompt], params)  # one untimed run: allocator, first prefill shape
    runs = [generator.generate([prompt], params) for _ in range(args.repeats)]
    assert len(runs[-1].results[0].token_ids) == args.new_tokens
    decode = statistics.median(r.stats.decode_tokens_per_s for r in runs)
    if args.profile:
        print_kernel_times(lambda: generator.generate([prompt], params), args.new_tokens,
                           args.profile)  # fmt: skip
    return decode, statistics.median(r.stats.tokens_per_s for r in runs), num_bytes


def print_kernel_times(run: Callable[[], object], tokens: int, top: int) -> None:
    """The `top` kernels of one more `run` by GPU time, µs a decoded token (prefill included,
    1 / `tokens` of it), and their share: where a decode step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = DEVICE == "cuda"  # (the CPU: its ops' own times)
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        run()
        _sync()
    time_of = attrgetter("self_device_time_total" if on_gpu else "self_cpu_time_total")
    kernels = [e for e in prof.key_averages() if time_of(e) > 0]
    total = sum(map(time_of, kernels))
    print(f"kernels, µs a token (all: {total / tokens:.1f}):", flush=True)
    for event in sorted(kernels, key=lambda e: -time_of(e))[:top]:
        each = time_of(event) / tokens
        share = 100 * time_of(event) / total
        print(f"  {each:8.1f} {share:5.1f}% x{event.count / tokens:5.1f}  {event.key[:110]}")


def bench_hf(preset: str, prompt: list[int], args) -> tuple[float, float, int]:
    """transformers' `generate` with its static cache (compiled by transformers) on the same
    bf16 weights saved as an artifact: its overall tokens/s and the weights' bytes."""
    import transformers

    with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
        model = make_model(preset, "bf16")
        num_bytes = weight_bytes(model)
        state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
        directory = Path(tmp) / "model"
        save_state(state, preset_args(preset), None, directory, stage="benchmark", parent=None)
        del model, state
        cleanup()
        model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        model = model.to(DEVICE).eval()
    model.generation_config.eos_token_id = None  # always new_tokens tokens
    input_ids = torch.tensor([prompt], device=DEVICE)
    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=args.new_tokens,
                  do_sample=False, pad_token_id=0, cache_implementation="static")  # fmt: skip

    def run():
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, **kwargs)
        _sync()
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()

    for _ in range(2):  # transformers compiles on the first calls
        run()
    runs = [run() for _ in range(args.repeats)]
    assert len(runs[-1][1]) == args.new_tokens, len(runs[-1][1])
    return 0.0, statistics.median(args.new_tokens / seconds for seconds, _ in runs), num_bytes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["llama3.2-1b", "llama3.2-3b"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
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
    parser.add_argument("--num-layers", type=int, help="shorten the presets to this many blocks")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="print the TOP kernels of one more lmforge run by GPU time")  # fmt: skip
    args = parser.parse_args()
    global DEVICE, NUM_LAYERS
    DEVICE, NUM_LAYERS = args.device, args.num_layers
    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (--device cpu measures the CPU)")

    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = []
    for preset in args.presets:
        model_args = preset_args(preset)
        prompt = torch.randint(
            0, model_args.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
        ).tolist()
        jobs = [(f"lmforge {scheme}", bench_lmforge, (scheme,)) for scheme in args.schemes]
        jobs = [job for job in jobs if "lmforge" in args.variants]
        jobs += [("hf-static bf16", bench_hf, ())] if "hf-static" in args.variants else []
        for variant, bench, extra in jobs:
            row = {"preset": preset, "variant": variant}
            try:  # -> decode and overall tokens/s, weight bytes
                decode, overall, num_bytes = bench(preset, prompt, *extra, args)
                limit = bandwidth / num_bytes
                rate = decode or overall  # transformers reports no decode-only rate
                row.update(
                    weight_gb=round(num_bytes / 1e9, 3),
                    limit_tok_s=round(limit),
                    decode_tok_s=round(decode, 1) if decode else None,
                    overall_tok_s=round(overall, 1),
                    pct_of_limit=round(100 * rate / limit, 1),
                    peak_mem_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2)
                    if DEVICE == "cuda"
                    else None,
                )
            except Exception as err:  # one failing variant must not lose the others
                traceback.print_exc()
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
            cleanup()

    summary = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }
    write_json(args.out, "decode.json", summary)
    print(f"\nbatch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens (tokens/s; decode:")
    print("prefill excluded; % of the bandwidth limit: decode, or overall for transformers)")
    for row in rows:
        print(" ".join(f"{key}={value}" for key, value in row.items()))


if __name__ == "__main__":
    main()
