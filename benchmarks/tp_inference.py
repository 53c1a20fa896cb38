"""Tensor-parallel inference through the real CLI, one GPU against two: `lmforge launch --nproc N
generate|eval` on a random-weight artifact of a preset (bf16), as a user runs it. generate-tpN:
batch 1, greedy, the decode tokens/s `lmforge generate` reports; eval-tpN: the demo's
multiple-choice task (demo_mc) with `lmforge eval`, its evaluating and wall seconds. Beside each
process's peak memory as the command reports it (the CPU's peak RSS with --device cpu), the
inference planner's allocated bytes a GPU (`plan_inference`, overhead left out) and their ratio.
--schemes int4-wo int8-wo: the one-GPU rows again on artifacts `lmforge quantize` makes with its
defaults (their load time and the quantized planner's rows; tensor parallelism takes bf16 only).

The artifact and a small BPE tokenizer of the demo corpus are written once to --work. Fills
docs/benchmarks.md's "Tensor-parallel inference" table (`bash benchmarks/device_calls.sh tp`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

GIB = 2**30
ROWS = ("generate-tp1", "generate-tp2", "eval-tp1", "eval-tp2")
QUANTIZED = ("int4-wo", "int8-wo")  # --schemes besides bf16: one GPU only


def write_world(work: Path, preset: str, device: str) -> dict[str, Path]:
    """The demo data, its tokenizer, the task YAMLs and the random artifact (made once)."""
    import torch

    from lmforge.api import build_model, save_state
    from lmforge.data.demo import write_demo_data
    from lmforge.data.tokenizer import load_tokenizer, train_bpe
    from lmforge.eval import write_demo_task
    from lmforge.models import get_preset

    paths = {"data": work / "data", "tokenizer": work / "tokenizer", "tasks": work / "tasks"}
    paths["artifact"] = work / f"{preset}-bf16"
    paths["mc"] = paths["data"] / "mc_heldout.jsonl"
    if not paths["mc"].exists():
        write_demo_data(paths["data"], num_people=256)  # 192 questions
    if not (paths["tokenizer"] / "tokenizer.json").exists():
        train_bpe([paths["data"] / "corpus.txt"], vocab_size=512, out_dir=paths["tokenizer"])
    write_demo_task(paths["mc"], paths["tasks"])
    if not (paths["artifact"] / "config.json").exists():
        start = time.perf_counter()
        tokenizer = load_tokenizer(paths["tokenizer"])
        args = get_preset(preset).replace(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
        model = build_model(args, device=device, dtype=torch.bfloat16, seed=0)
        save_state(model.state_dict(), args, tokenizer, paths["artifact"], stage="convert",
                   parent=preset)  # fmt: skip
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"wrote {paths['artifact']} in {time.perf_counter() - start:.0f} s", flush=True)
    return paths


def prompt_of_length(paths: dict, num_tokens: int) -> str:
    """The shortest prefix of the demo corpus `lmforge generate` encodes to >= num_tokens."""
    from lmforge.api import read_args
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.generate.sequence import encode_prompt

    tokenizer = load_tokenizer(paths["tokenizer"])
    vocab_size = read_args(paths["artifact"]).vocab_size
    words = (paths["data"] / "corpus.txt").read_text().split()
    for count in range(1, len(words) + 1):
        text = " ".join(words[:count])
        if len(encode_prompt(text, tokenizer, vocab_size=vocab_size)) >= num_tokens:
            return text
    raise SystemExit(f"the demo corpus is shorter than {num_tokens} tokens")


def eval_shape(paths: dict) -> tuple[int, int]:
    """Tokens of the longest demo_mc request (BOS included) and of the longest choice."""
    from lmforge.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(paths["tokenizer"])
    longest, scored = 0, 0
    for line in paths["mc"].read_text().splitlines():
        row = json.loads(line)
        context = f"Question: {row['question']}\nAnswer:"
        for choice in row["choices"]:
            longest = max(longest, 1 + len(tokenizer.encode(f"{context} {choice}")))
            scored = max(scored, len(tokenizer.encode(f" {choice}")))
    return longest, scored


def quantized_artifact(paths: dict, scheme: str, args) -> Path:
    """`lmforge quantize` of the bf16 artifact with its defaults (made once), as a user runs it."""
    out = paths["artifact"].with_name(paths["artifact"].name.replace("-bf16", f"-{scheme}"))
    if not (out / "config.json").exists():
        command = [sys.executable, "-m", "lmforge", "quantize", str(paths["artifact"]), str(out)]
        start = time.perf_counter()
        subprocess.run([*command, "--scheme", scheme, "--device", args.device, "--overwrite"],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        print(f"quantized {scheme} in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def row_command(row: str, artifact: Path, paths: dict, prompt: str, out_dir: Path, args) -> list:
    kind, tp = row.split("-tp")
    command = [sys.executable, "-m", "lmforge", "launch", "--nproc", tp, kind]
    command += [str(artifact), "--device", args.device]
    if kind == "generate":
        command += ["--prompt", prompt, "--temperature", "0", "--max-batch", "1"]
        command += [] if args.compile else ["--no-compile"]
        return [*command, "--max-new-tokens", str(args.new_tokens)]
    command += ["--tasks", "demo_mc", "--include-path", str(paths["tasks"]), "--offline"]
    command += ["--limit", str(args.limit)] if args.limit else []
    return [*command, "--batch-size", str(args.batch_size), "--out", str(out_dir)]


def gigabytes(text: str) -> float:
    """'8.40 GB' or '512.3 MB' or '96.0 kB' (generate's report) -> GiB."""
    value, unit = text.split()
    return float(value) * {"GB": 1e9, "MB": 1e6, "kB": 1e3}[unit] / GIB


def measured_generate(log: str) -> dict:
    decode = re.search(r"tokens/s:\s+([\d.]+) decode", log)
    counts = re.search(r"\[1\] (\d+) prompt tokens, (\d+) new", log)
    peak = re.search(r"peak memory: ([\d.]+ [kMG]B) \(([^)]*)\)", log)
    if not (decode and counts and peak):
        return {"error": "no speed report in the log: " + log[-600:]}
    achieved = re.search(r"bandwidth:\s+([\d.e+]+) GB/s achieved \(([\d.]+ [kMG]B) of", log)
    load = re.search(r"loaded .* in ([\d.]+)s", log)
    compiled = re.search(r"compiled in ([\d.]+)s", log)
    each = re.search(r"per process: (.*)$", peak.group(2))
    peaks = [gigabytes(t) for t in each.group(1).split(", ")] if each else [gigabytes(peak[1])]
    return {
        "decode_tokens_per_s": float(decode.group(1)),
        "prompt_tokens": int(counts.group(1)),
        "new_tokens": int(counts.group(2)),
        "peak_gib": peaks,
        "bandwidth_gb_s": float(achieved.group(1)) if achieved else None,
        "weight_gib": gigabytes(achieved.group(2)) if achieved else None,
        "load_s": float(load.group(1)) if load else None,
        "compile_s": float(compiled.group(1)) if compiled else None,
    }


def measured_eval(out_dir: Path) -> dict:
    (written,) = out_dir.glob("results-*.json")
    results = json.loads(written.read_text())
    runtime = results["lmforge"]["runtime"]
    return {
        "eval_s": runtime["evaluate_s"],
        "acc": results["results"]["demo_mc"]["acc,none"],
        "questions": results["n-samples"]["demo_mc"]["effective"],
        "peak_gib": [peak / GIB for peak in runtime["process_peak_memory_bytes"]],
    }


def planned(row: str, scheme: str, shape: dict, args) -> dict:
    """The inference planner's allocated GiB a GPU for the row (total less overhead)."""
    from lmforge.models import get_preset
    from lmforge.plan.inference import InferenceSetup, format_inference_plan, plan_inference

    kind, tp = row.split("-tp")
    setup = InferenceSetup(args=get_preset(args.preset), tp=int(tp), dtype="bf16",
                           quantization=None if scheme == "bf16" else scheme,
                           int4_packed=args.device == "cuda")  # fmt: skip
    if kind == "generate":
        chunk = 2048 if args.device == "cuda" else 512  # the engine's default prefill chunk
        setup = setup.replace(task="generate", batch=1, prefill_chunk=chunk,
                              seq_len=shape["prompt_tokens"] + args.new_tokens)  # fmt: skip
    else:
        setup = setup.replace(task="score", batch=args.batch_size, seq_len=shape["eval_tokens"],
                              scored_tokens=shape["eval_scored"])  # fmt: skip
    plan = plan_inference(setup)
    return {"plan_gib": plan.peak_allocated / GIB, "plan_total_gib": plan.total / GIB,
            "plan_text": format_inference_plan(plan)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--schemes", nargs="+", default=["bf16"], choices=["bf16", *QUANTIZED])
    parser.add_argument("--preset", default="llama3.1-8b")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="eval: sequences a forward")
    parser.add_argument("--limit", type=int, help="eval: questions (default: all 192)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lmforge-tp-inference"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    paths = write_world(args.work, args.preset, args.device)
    prompt = prompt_of_length(paths, args.prompt_tokens)
    shape = dict(zip(("eval_tokens", "eval_scored"), eval_shape(paths)))
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    results = {"copy_bandwidth_gb_s": None}
    if args.device == "cuda":  # decode.py's limit, measured in this process
        from benchmarks.decode import copy_bandwidth

        results["copy_bandwidth_gb_s"] = copy_bandwidth() / 1e9
    jobs = [(r, s) for s in args.schemes for r in args.rows if s == "bf16" or "-tp1" in r]
    for row, scheme in jobs:
        artifact = (
            paths["artifact"] if scheme == "bf16" else quantized_artifact(paths, scheme, args)
        )
        name = row if scheme == "bf16" else f"{row}-{scheme}"
        out_dir = args.work / "eval" / name
        shutil.rmtree(out_dir, ignore_errors=True)  # an earlier run's results
        command = row_command(row, artifact, paths, prompt, out_dir, args)
        log = args.out / f"{name}.log"
        start = time.perf_counter()
        with log.open("w") as out:
            code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - start
        text = log.read_text()
        if code != 0:
            result = {"error": f"exit {code}: " + text[-600:]}
        elif row.startswith("generate"):
            result = measured_generate(text)
        else:
            result = measured_eval(out_dir)
        result["wall_s"] = wall
        if "error" not in result:
            plan = planned(row, scheme, {**shape, **result}, args)
            print(plan.pop("plan_text"), flush=True)
            ratio = max(result["peak_gib"]) / plan["plan_gib"]  # RSS on the CPU: none
            result.update(plan, ratio=ratio if args.device == "cuda" else None)
            if result.get("bandwidth_gb_s") and results["copy_bandwidth_gb_s"]:
                result["pct_of_limit"] = (
                    100 * result["bandwidth_gb_s"] / results["copy_bandwidth_gb_s"]
                )
        results[name] = result
        print(name, json.dumps(result), flush=True)
    (args.out / "tp_inference.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
