"""Load on `lmforge serve`: throughput (generated tokens/s) and latency at several concurrencies.

At each concurrency c, c client threads send streaming completion requests back to back
(`ignore_eos`: exactly --max-tokens each) until --requests have finished; per level: tokens/s
over the level's wall time, p50/p99 of latency and time to first token. The server is started
here on --artifact, or on random bf16 weights of --preset with a small BPE tokenizer of this
script's words, and stopped at the end. Only the standard library on the client side.

Fills docs/benchmarks.md's "Serving" table (`bash benchmarks/device_calls.sh serve`) and its
quantized rows (`--schemes bf16 int8-wo int4-wo`, `device_calls.sh quantized-serve`).
`--json-every N`: every Nth request asks for structured output (`response_format` with
`SCHEMA`; 2: half the streams constrained, `device_calls.sh structured-serve`).
`--adapters N`: N random rank-`--adapter-rank` LoRA adapters on every q/k/v/o and MLP linear,
served with `--lora`, request i naming adapter i mod N (`device_calls.sh adapters-serve` runs
0 and 8).
`--shared-prefix-words N`: every prompt starts with the same N words (a system prompt), then
its own; with `--prefix-cache-tokens 0` the server keeps no prompt blocks
(`device_calls.sh prefix-serve` runs both).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "models", "learn", "from", "text", "and",
         "tokens"]  # fmt: skip
# --json-every's schema: an open-ended array, so a constrained request's tokens stay in the
# grammar for most of --max-tokens (a random model closes it at random)
SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string"}}},
    "required": ["words"],
}


class Client:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.headers = {"Content-Type": "application/json"}

    def get(self, path: str) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            connection.request("GET", path, headers=self.headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def stream_completion(self, body: dict) -> dict:
        """One streaming request: latency, time to first token, completion tokens."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=600)
        start = time.perf_counter()
        first = None
        tokens = prompt = cached = 0
        try:
            connection.request("POST", "/v1/completions", json.dumps(body), self.headers)
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: ") :])
                if event.get("usage"):
                    usage = event["usage"]
                    tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    prompt, cached = usage["prompt_tokens"], details.get("cached_tokens") or 0
                elif first is None and event.get("choices"):
                    first = time.perf_counter() - start
        finally:
            connection.close()
        latency = time.perf_counter() - start
        return {"latency": latency, "ttft": first or 0.0, "tokens": tokens, "prompt": prompt,
                "cached": cached}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def run_level(client: Client, model: str, concurrency: int, num_requests: int, args) -> dict:
    counter = iter(range(num_requests))
    lock = threading.Lock()
    results: list[dict] = []

    def worker() -> None:
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            words = " ".join(WORDS[(index + i) % len(WORDS)] for i in range(args.prompt_words))
            shared = " ".join(WORDS[i % len(WORDS)] for i in range(args.shared_prefix_words))
            name = f"adapter-{index % args.adapters}" if args.adapters else model
            body = {
                "model": name,
                "prompt": f"{shared} {index}: {words}" if shared else f"{index}: {words}",
                "max_tokens": args.max_tokens,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.json_every and index % args.json_every == 0:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "words", "schema": SCHEMA},
                }
            result = client.stream_completion(body)
            with lock:
                results.append(result)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    wall = time.perf_counter() - start
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "p50_latency_s": statistics.median(latencies),
        "p99_latency_s": percentile(latencies, 99),
        "p50_ttft_s": statistics.median(ttfts),
        "p99_ttft_s": percentile(ttfts, 99),
        "prompt_tokens": statistics.mean(r["prompt"] for r in results),
        "cached_tokens": statistics.mean(r["cached"] for r in results),
    }


def preset_artifact(preset: str, root: Path, num_layers: int | None = None) -> Path:
    """Random bf16 weights of `preset` (shortened to `num_layers` blocks: a large MoE on one
    GPU) with a BPE tokenizer of this script's words."""
    import torch

    import lmforge
    from lmforge.api import LoadedModel, build_model
    from lmforge.data.tokenizer import train_bpe
    from lmforge.models import get_preset

    corpus = root / "words.txt"
    corpus.write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))))
    tokenizer = train_bpe([corpus], vocab_size=300, out_dir=root / "tokenizer")
    args = get_preset(preset)
    args = args.replace(num_layers=num_layers) if num_layers else args
    model = build_model(args, dtype=torch.bfloat16, seed=0)
    # Ids past the tokenizer's 300 decode to no text, and a stream sends no event for them: a
    # random model would then show its first token only at the end. With their embedding rows
    # zero, their logits are 0 and greedy picks a real token (one of 300 random logits is > 0).
    with torch.no_grad():
        model.tok_embeddings.weight[tokenizer.vocab_size :] = 0
        model.output.weight[tokenizer.vocab_size :] = 0  # the same tensor when tied
    loaded = LoadedModel(model=model, tokenizer=tokenizer, config=args, source=preset)
    return lmforge.save(loaded, root / "artifact")


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    log = Path(tempfile.mkstemp(prefix="serve_load_", suffix=".log")[1])
    command = [sys.executable, "-m", "lmforge", "serve", str(args.artifact), "--port", "0"]
    command += ["--max-concurrency", str(args.max_concurrency), "--device", args.device]
    command += ["--max-queue", str(max(args.concurrency) * 2), "--log-level", "warning"]
    if args.max_seq_len:
        command += ["--max-seq-len", str(args.max_seq_len)]
    if args.num_threads:
        command += ["--num-threads", str(args.num_threads)]
    if args.prefix_cache_tokens is not None:
        command += ["--prefix-cache-tokens", str(args.prefix_cache_tokens)]
    for index in range(args.adapters):
        command += ["--lora", f"adapter-{index}={args.artifact.parent / f'adapter-{index}'}"]
    if args.adapters:
        command += ["--max-lora-rank", str(args.adapter_rank)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while True:
        found = re.search(r"on (http://[^/\s]+)/v1", log.read_text())
        if found:
            url = found.group(1)
            try:
                if Client(url).get("/health")[0] == 200:
                    return process, url, log
            except OSError:
                pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--artifact", type=Path, help="start `lmforge serve` on this artifact")
    target.add_argument("--preset", help="start `lmforge serve` on random weights of a preset")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=None, help="per level (4 x c, >= 8)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    # --preset's random model: ids past its tokenizer's 300 stream no text; sample with top-k <= 50
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2, help="requests before measuring")
    # The server:
    parser.add_argument("--max-concurrency", type=int, default=32, help="server rows (32)")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--num-layers", type=int, help="--preset shortened to this many blocks")
    parser.add_argument("--json-every", type=int, default=0, metavar="N",
                        help="every Nth request constrained by a JSON schema (0: none)")  # fmt: skip
    parser.add_argument("--num-threads", type=int, default=None, help="server CPU threads")
    parser.add_argument(
        "--adapters",
        type=int,
        default=0,
        metavar="N",
        help="serve N random LoRA adapters, requests naming them in turn",
    )
    parser.add_argument("--adapter-rank", type=int, default=16)
    parser.add_argument("--shared-prefix-words", type=int, default=0, metavar="N",
                        help="every prompt starts with the same N words")  # fmt: skip
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the server's --prefix-cache-tokens (0: off; default: its own)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--schemes",
        nargs="+",
        default=["bf16"],
        help="bf16 (as is), int8-wo, int4-wo (quantized); SCHEME/FORMAT for another --format "
        "of `lmforge quantize` (e.g. int4-wo/compressed-tensors)",
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()

    if args.preset is not None:
        root = Path(tempfile.mkdtemp(prefix="serve_load_"))
        args.artifact = preset_artifact(args.preset, root, args.num_layers)
    results, source = {}, args.artifact
    for index in range(args.adapters):
        random_adapter(source, source.parent / f"adapter-{index}", args.adapter_rank, index)
    for scheme in args.schemes:
        artifact = source if scheme == "bf16" else quantized(source, scheme, args)
        model, rows = serve_and_load(artifact, args)
        print_table(f"{model!r}, {scheme}", rows, args)
        results[scheme] = {"model": model, "max_tokens": args.max_tokens, "levels": rows}
    if len(results) > 1 and "bf16" in results:
        print_ratios(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_load.json").write_text(json.dumps(results, indent=2))


def random_adapter(artifact: Path, out: Path, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of `rank` with random A and B (bf16, small) on every q/k/v/o and
    MLP linear of `artifact`'s model, as `lmforge sft` with LoRA writes one."""
    import torch
    from safetensors.torch import save_file

    from lmforge import models
    from lmforge.api import read_args

    args = read_args(artifact)
    targets = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
               "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # fmt: skip
    shapes = {"wq": (args.q_dim, args.dim), "wk": (args.kv_dim, args.dim),
              "wv": (args.kv_dim, args.dim), "wo": (args.dim, args.q_dim),
              "w1": (args.ffn_dim, args.dim), "w3": (args.ffn_dim, args.dim),
              "w2": (args.dim, args.ffn_dim)}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.num_layers):
        for ours, (rows, cols) in shapes.items():
            part = "attention" if ours in ("wq", "wk", "wv", "wo") else "feed_forward"
            hf = models.ours_to_hf(f"layers.{layer}.{part}.{ours}.weight", args)
            prefix = "base_model.model." + hf.removesuffix(".weight")
            for name, shape in (("A", (rank, cols)), ("B", (rows, rank))):
                values = torch.randn(shape, generator=generator) * 0.01
                tensors[f"{prefix}.lora_{name}.weight"] = values.bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": sorted(targets.values()), "bias": "none"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))


def quantized(source: Path, scheme: str, args) -> Path:
    """`lmforge quantize SOURCE OUT --scheme SCHEME [--format FORMAT]` (`scheme`: SCHEME or
    SCHEME/FORMAT) with its defaults otherwise, as a user makes it."""
    out = source.parent / scheme.replace("/", "-")
    command = [sys.executable, "-m", "lmforge", "quantize", str(source), str(out)]
    name, _, form = scheme.partition("/")
    command += ["--scheme", name, "--overwrite"] + (["--format", form] if form else [])
    command += [] if args.device == "auto" else ["--device", args.device]
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    print(f"quantized {scheme} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


def serve_and_load(artifact: Path, args) -> tuple[str, list[dict]]:
    """Start `lmforge serve` on `artifact`, run every concurrency level, stop it."""
    args.artifact = artifact
    start = time.perf_counter()
    process, url, log = start_server(args)
    print(f"started lmforge serve on {url} in {time.perf_counter() - start:.1f} s (log: {log})",
          file=sys.stderr)  # fmt: skip
    try:
        client = Client(url)
        status, body = client.get("/v1/models")
        if status != 200:
            raise SystemExit(f"GET /v1/models: HTTP {status}: {body[:200]!r}")
        model = json.loads(body)["data"][0]["id"]
        for _ in range(args.warmup):
            run_level(client, model, 1, 1, args)
        rows = []
        for concurrency in args.concurrency:
            num_requests = args.requests or max(8, 4 * concurrency)
            rows.append(run_level(client, model, concurrency, num_requests, args))
            print(f"concurrency {concurrency}: done", file=sys.stderr, flush=True)
    finally:
        process.terminate()
        process.wait(timeout=120)
    return model, rows


def print_table(name: str, rows: list[dict], args) -> None:
    print(f"\nlmforge serve load: model {name}, {args.max_tokens} new tokens per request")
    header = (
        f"{'concurrency':>11} {'requests':>8} {'tokens/s':>9} {'p50 lat s':>9} "
        f"{'p99 lat s':>9} {'p50 TTFT s':>10} {'p99 TTFT s':>10} {'prompt':>7} {'cached':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['concurrency']:>11} {row['requests']:>8} {row['tokens_per_s']:>9.1f} "
            f"{row['p50_latency_s']:>9.3f} {row['p99_latency_s']:>9.3f} "
            f"{row['p50_ttft_s']:>10.3f} {row['p99_ttft_s']:>10.3f} "
            f"{row['prompt_tokens']:>7.0f} {row['cached_tokens']:>7.0f}"
        )


def print_ratios(results: dict) -> None:
    """tokens/s of each scheme as a multiple of bf16's, and p99 TTFT, by concurrency."""
    schemes = list(results)
    print("\nstreams | " + " | ".join(f"{s} tok/s (x bf16, p99 TTFT s)" for s in schemes))
    base = {r["concurrency"]: r for r in results["bf16"]["levels"]}
    for level in results["bf16"]["levels"]:
        c = level["concurrency"]
        cells = []
        for scheme in schemes:
            row = next(r for r in results[scheme]["levels"] if r["concurrency"] == c)
            ratio = row["tokens_per_s"] / base[c]["tokens_per_s"]
            cells.append(f"{row['tokens_per_s']:,.0f} ({ratio:.2f}x, {row['p99_ttft_s']:.3f})")
        print(f"{c} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
