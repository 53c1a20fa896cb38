"""Peak host memory of `lmforge quantize`: streaming (tensor by tensor from the safetensors
shards) against the whole-model path, on the CPU.

A random-init preset is saved once as a bf16 artifact; each quantization runs in a fresh
subprocess that reports its peak resident set and the one after importing torch and torchao.
Fills docs/benchmarks.md's quantization-memory table (CPU; no device call): a markdown table on
stdout, the rows as JSON to --out (default $OUT/quantize_memory.json when $OUT is set).

    PYTHONPATH=$PWD python3 benchmarks/quantize_memory.py --preset tiny --schemes int8-wo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1024**3


def _maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def make_source(preset: str, directory: Path) -> None:
    """Child: a random-init bf16 artifact of `preset`."""
    import lmforge

    loaded = lmforge.load(preset, dtype="bfloat16")
    lmforge.save(loaded, directory, stage="benchmark")


def quantize_child(source: str, out: str, scheme: str, stream: bool, shard: str) -> dict:
    """Child: one quantization; its peak RSS, the RSS floor after imports, and the time."""
    import torch  # noqa: F401 (the floor counts torch and torchao)

    from lmforge.quantize import quantize_artifact
    from lmforge.quantize.stored import require_torchao

    require_torchao()
    floor = _maxrss_bytes()
    start = time.perf_counter()
    result = quantize_artifact(
        source, out, scheme=scheme, device="cpu", stream=stream, max_shard_size=shard
    )
    return {
        "scheme": scheme,
        "path": "streaming" if result.streamed else "whole model",
        "max_shard_size": shard,
        "seconds": round(time.perf_counter() - start, 1),
        "peak_rss_bytes": _maxrss_bytes(),
        "floor_rss_bytes": floor,
        "source_bytes": result.original.disk_bytes,
        "artifact_bytes": result.quantized.disk_bytes,
    }


def _run_child(*args: str) -> str:
    command = [sys.executable, __file__, "--child", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--schemes", nargs="+", default=["int8-wo", "int4-wo"])
    # max shard sizes of the streaming runs (the whole-model run uses the first)
    parser.add_argument("--stream-shard-sizes", nargs="+", default=["5GB", "512MB"])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child[0] == "source":
            make_source(args.child[1], Path(args.child[2]))
        else:
            source, out, scheme, stream, shard = args.child
            print(json.dumps(quantize_child(source, out, scheme, stream == "stream", shard)))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="quantize_memory_"))
    workdir.mkdir(parents=True, exist_ok=True)
    source = workdir / f"{args.preset}-bf16"
    if not source.exists():
        _run_child("source", args.preset, str(source))
    rows = []
    for scheme in args.schemes:
        runs = [("whole", args.stream_shard_sizes[0])]
        runs += [("stream", shard) for shard in args.stream_shard_sizes]
        for mode, shard in runs:
            out = workdir / f"{scheme}-{mode}-{shard}"
            rows.append(json.loads(_run_child(str(source), str(out), scheme, mode, shard)))
            print(rows[-1], file=sys.stderr)
    print(f"{args.preset}, random init, bf16 source {_gib(rows[0]['source_bytes'])} GiB on disk\n")
    print(
        "| scheme | path | max shard | peak RSS (GiB) | above imports (GiB) | time (s) "
        "| artifact (GiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        above = row["peak_rss_bytes"] - row["floor_rss_bytes"]
        print(
            f"| {row['scheme']} | {row['path']} | {row['max_shard_size']} | "
            f"{_gib(row['peak_rss_bytes'])} | {_gib(above)} | {row['seconds']} | "
            f"{_gib(row['artifact_bytes'])} |"
        )
    out = args.out or (
        Path(os.environ["OUT"]) / "quantize_memory.json" if "OUT" in os.environ else None
    )
    if out is not None:
        out.write_text(json.dumps({"preset": args.preset, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
