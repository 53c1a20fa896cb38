"""Batch-1 decode speed on one GPU (or the CPU): lmforge's `Generator` (static KV cache, decode
step compiled with CUDA graphs on a GPU) side by side with Hugging Face transformers' `generate`
on the same weights, against the memory-bandwidth limit.

Fills docs/benchmarks.md's "Decode" table (bf16 rows, transformers beside them) and the
quantized decode rows of its "Quantized" section (`--schemes int8-wo int4-wo ...`);
`bash benchmarks/device_calls.sh decode` runs both presets.

Rows: lmforge's decode tokens/s (prefill excluded) on random weights in each --schemes, and
transformers' static-cache `generate` (compiled by transformers) on the same bf16 weights saved
as an artifact, greedy; the limit = device copy bandwidth / weight bytes read a token.

    python benchmarks/decode.py                                  # 1B and 3B, both variants
    python benchmarks/decode.py --presets llama3.2-1b --variants lmforge hf-static
    python benchmarks/decode.py --schemes bf16 int8-wo int4-wo
    python benchmarks/decode.py --device cpu --presets tiny --schemes fp32 --variants lmforge

Each variant compiles first (about a minute for lmforge and for hf-static); with a 10-minute
limit per command, run one preset per command. Writes decode.json to --out ($OUT if set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from lmforge.api import build_model, save_state
from lmforge.generate import Generator, SamplingParams
from lmforge.generate.generate import weight_bytes
from lmforge.models.llama import get_preset


# Weight schemes for lmforge rows: each takes the bf16 model (on the device) and returns it with
# its linear weights quantized by lmforge's quantize module, as `lmforge quantize` does.
# `weight_bytes` counts packed data and scales, so each row's limit follows its own bytes.
def _quantized(
    scheme: str, group_size: int | None, *, output: bool = False
) -> Callable[[nn.Module], nn.Module]:
    def apply(model: nn.Module) -> nn.Module:
        from lmforge.quantize.quantize import QuantSpec, quantize_model

        spec = QuantSpec(scheme, group_size=group_size, quantize_output=output)
        quantize_model(model, spec)
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
    _cleanup()
    return 2 * num_bytes * iterations / seconds


def _peak_gb() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if DEVICE == "cuda" else None


def make_model(preset: str, scheme: str) -> nn.Module:
    model = build_model(get_preset(preset), device=DEVICE, dtype=torch.bfloat16, seed=0)
    return SCHEMES[scheme](model.eval())


def bench_lmforge(model, prompt: list[int], new_tokens: int, repeats: int, *, compile: bool):
    generator = Generator(
        model,
        max_batch=1,
        max_seq_len=len(prompt) + new_tokens,
        device=DEVICE,
        compile=compile,
    )
    generator.warmup()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, stop_token_ids=())
    generator.generate([prompt], params)  # one untimed run: allocator, first prefill shape
    runs = [generator.generate([prompt], params) for _ in range(repeats)]
    assert len(runs[-1].results[0].token_ids) == new_tokens
    decode = statistics.median(r.stats.decode_tokens_per_s for r in runs)
    overall = statistics.median(r.stats.tokens_per_s for r in runs)
    return decode, overall


def bench_hf(directory: Path, prompt: list[int], new_tokens: int, repeats: int):
    """transformers' `generate` with its static cache (which transformers compiles itself)."""
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
        cache_implementation="static",
    )

    def run():
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, **kwargs)
        _sync()
        return time.perf_counter() - start, out[0, len(prompt) :].tolist()

    for _ in range(2):  # transformers compiles on the first calls
        run()
    runs = [run() for _ in range(repeats)]
    tokens = runs[-1][1]
    assert len(tokens) == new_tokens, len(tokens)
    return statistics.median(new_tokens / seconds for seconds, _ in runs)


def lmforge_row(preset: str, prompt: list[int], scheme: str, args) -> tuple[float, float, int]:
    """lmforge's decode and overall tokens/s on `scheme`'s weights, and their bytes."""
    model = make_model(preset, scheme)
    num_bytes = weight_bytes(model)  # as quantized, before the engine converts it
    decode, overall = bench_lmforge(
        model, prompt, args.new_tokens, args.repeats, compile=DEVICE == "cuda"
    )
    return decode, overall, num_bytes


def hf_row(preset: str, prompt: list[int], args) -> tuple[float, float, int]:
    """transformers' overall tokens/s on the same bf16 weights, saved as an artifact."""
    with tempfile.TemporaryDirectory(prefix="decode-bench-") as tmp:
        model = make_model(preset, "bf16")
        num_bytes = weight_bytes(model)
        state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
        directory = Path(tmp) / "model"
        save_state(state, get_preset(preset), None, directory, stage="benchmark", parent=None)
        del model, state
        _cleanup()
        return 0.0, bench_hf(directory, prompt, args.new_tokens, args.repeats), num_bytes


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
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (--device cpu measures the CPU)")

    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = []

    def record(row: dict, run: Callable[[], tuple[float, float, int]]) -> None:
        """Run one variant (-> decode and overall tokens/s, weight bytes) into `row`."""
        try:
            decode, overall, num_bytes = run()
            limit = bandwidth / num_bytes
            rate = decode or overall  # transformers reports no decode-only rate
            row.update(
                weight_gb=round(num_bytes / 1e9, 3),
                limit_tok_s=round(limit),
                decode_tok_s=round(decode, 1) if decode else None,
                overall_tok_s=round(overall, 1),
                pct_of_limit=round(100 * rate / limit, 1),
                peak_mem_gb=_peak_gb(),
            )
        except Exception as err:  # one failing variant must not lose the others
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
        _cleanup()

    for preset in args.presets:
        model_args = get_preset(preset)
        prompt = torch.randint(
            0, model_args.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
        ).tolist()

        if "lmforge" in args.variants:
            for scheme in args.schemes:
                record(
                    {"preset": preset, "variant": f"lmforge {scheme}"},
                    partial(lmforge_row, preset, prompt, scheme, args),
                )
        if "hf-static" in args.variants:
            record(
                {"preset": preset, "variant": "hf-static bf16"},
                partial(hf_row, preset, prompt, args),
            )

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
    print(f"\nbatch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens (tokens/s; decode:")
    print("prefill excluded; % of the bandwidth limit: decode, or overall for transformers)")
    for row in rows:
        print(" ".join(f"{key}={value}" for key, value in row.items()))


if __name__ == "__main__":
    main()
