"""Where a profiled training step's GPU time goes, from a torch.profiler Chrome trace (as
`profile.enabled = true` writes to `<run_dir>/profile/`): the span of the GPU work, time with
compute kernels running, time with collectives (NCCL) running, collectives not hidden behind
compute (exposed communication), idle time, and the largest kernels.

    python benchmarks/trace_summary.py RUN_DIR/profile/rank0.*.pt.trace.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import itertools
import json
from pathlib import Path


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a, b) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# Kernel families, by the first pattern found in the kernel's (lower-cased) name.
CATEGORIES = [
    ("collective", ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "wgmma", "cublas")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("triton (fused elementwise/reductions)", ("triton",)),
    ("copies", ("memcpy", "memset", "copy", "cat")),
]


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    for label, patterns in CATEGORIES:
        if any(p in name for p in patterns):
            return label
    return "other"


def _load(path: Path) -> tuple[list[dict], list[dict], int]:
    """A trace's events, its kernels, and how many profiler steps it holds."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    steps = sum(
        str(e.get("name", "")).startswith("ProfilerStep#")
        and e.get("cat") != "gpu_user_annotation"  # the host-side marks only
        for e in events
    )
    return events, kernels, steps


def summarize(path: Path, top: int = 8) -> str:
    events, kernels, steps = _load(path)
    if not kernels:
        return f"{path}: no GPU kernels in the trace"
    is_comm = [("nccl" in e["name"].lower()) for e in kernels]
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e, c in zip(kernels, is_comm) if not c])
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e, c in zip(kernels, is_comm) if c])
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = _length(_union(compute + comm))
    overlap = _intersection(compute, comm)
    per_kernel: dict[str, float] = collections.defaultdict(float)
    per_category: dict[str, float] = collections.defaultdict(float)
    for e in kernels:
        per_kernel[e["name"][:90]] += e["dur"]
        per_category[category(e["name"])] += e["dur"]
    n = max(steps, 1)
    ms = 1e3 * n  # trace times are in microseconds; report per step in ms
    lines = [
        f"{path.name}: {steps} profiled steps, per step:",
        f"  GPU span {span / ms:.3f} ms; compute {_length(compute) / ms:.3f} ms; "
        f"collectives {_length(comm) / ms:.3f} ms, of which hidden behind compute "
        f"{overlap / ms:.3f} ms, exposed {(_length(comm) - overlap) / ms:.3f} ms; "
        f"idle {(span - busy) / ms:.3f} ms; {len(kernels) / n:.0f} kernels",
        "  by kind (ms per step): "
        + "; ".join(
            f"{label} {total / ms:.3f}"
            for label, total in sorted(per_category.items(), key=lambda kv: -kv[1])
        ),
        "  largest kernels (ms per step):",
    ]
    for name, total in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {total / ms:7.3f}  {name}")
    lines += idle_gaps(events, kernels, _union(compute + comm))
    return "\n".join(lines)


def added_by_kernel(path: Path, top: int = 16) -> str:
    """For kernels that run one after another, each launched before the one before it ends (a
    decode step launched early): what each adds to the span, its end minus the end before it,
    by kernel name and grid (a decode step's products differ in grid), per step and per launch.
    A kernel's own duration there counts the wait for the one before."""
    _, kernels, steps = _load(path)
    kernels.sort(key=lambda e: e["ts"] + e["dur"])
    steps = max(steps, 1)
    added: dict[str, float] = collections.defaultdict(float)
    launches: collections.Counter = collections.Counter()
    for before, kernel in itertools.pairwise(kernels):
        key = f"{kernel['name'][:40]} grid {kernel.get('args', {}).get('grid')}"
        added[key] += kernel["ts"] + kernel["dur"] - before["ts"] - before["dur"]
        launches[key] += 1
    lines = ["  added to the span, by kernel and grid: ms per step, us per launch, launches/step"]
    for key, total in sorted(added.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(
            f"    {total / 1e3 / steps:7.3f}  {total / launches[key]:6.2f}  "
            f"{launches[key] / steps:5.1f}  {key}"
        )
    return "\n".join(lines)


def idle_gaps(events: list[dict], kernels: list[dict], busy, top: int = 5) -> list[str]:
    """The longest stretches with no kernel running, each with the kernels around it and the
    host operations that overlap it most (what the GPU was waiting for)."""
    gaps = sorted(
        ((busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)),
        key=lambda gap: gap[0] - gap[1],
    )[:top]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    by_end = sorted(kernels, key=lambda e: e["ts"] + e["dur"])
    ends = [e["ts"] + e["dur"] for e in by_end]
    lines = ["  longest idle gaps (ms): after kernel -> before kernel; host ops overlapping most"]
    for start, end in gaps:
        before = by_end[max(bisect.bisect_right(ends, start) - 1, 0)]["name"][:40]
        after = min((e for e in kernels if e["ts"] >= end), key=lambda e: e["ts"])["name"][:40]
        overlaps = collections.Counter()
        for e in host:
            shared = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
            if shared > 0:
                overlaps[e["name"][:50]] = max(overlaps[e["name"][:50]], shared)
        busiest = ", ".join(f"{name} {t / 1e3:.2f}" for name, t in overlaps.most_common(4))
        lines.append(f"    {(end - start) / 1e3:6.3f}  {before} -> {after}; {busiest}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=8, help="how many of the largest kernels")
    args = parser.parse_args()
    for trace in args.traces:
        print(summarize(trace, top=args.top))


if __name__ == "__main__":
    main()
