"""The floor under a batch-1 decode step's kernels on this GPU, to read each kernel's time in the
step against (decode_profile.py prints what each one adds):

1. chain: a CUDA graph of tiny dependent kernels (each program adds 1 to its own float), at
   several grid sizes, launched early (early_launch.py) or not: what a kernel boundary costs;
2. barrier: one persistent kernel, a program a multiprocessor, whose programs meet R times at
   a grid-wide barrier (an atomic count, then a spin): what a barrier costs inside a kernel,
   the alternative to a boundary;
3. stream: one kernel reading a buffer of each size the 1B's and 3B's products read, at the
   best of a few grid shapes, each launch in a CUDA graph of 20 dependent launches: the least
   time a kernel of that size takes, beside the bandwidth limit.

    python3 benchmarks/launch_floor.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common import graph_us
from lmforge.generate.early_launch import wait_for_previous

COPY_TB_S = 4.28  # measured copy bandwidth of an H200 (docs/benchmarks.md): the limit column


@triton.jit
def _touch(x_ptr, EARLY: tl.constexpr):
    wait_for_previous(EARLY)
    at = x_ptr + tl.program_id(0)
    tl.store(at, tl.load(at) + 1.0)


@triton.jit
def _barriers(count_ptr, x_ptr, ROUNDS: tl.constexpr):
    program, programs = tl.program_id(0), tl.num_programs(0)
    at = x_ptr + program
    for round in range(ROUNDS):
        tl.store(at, tl.load(at) + 1.0)
        tl.debug_barrier()  # the program's store before its count
        tl.atomic_add(count_ptr, 1, sem="release")
        target = (round + 1) * programs
        seen = tl.load(count_ptr, volatile=True)
        while seen < target:
            seen = tl.load(count_ptr, volatile=True)
        tl.atomic_add(count_ptr, 0, sem="acquire")  # the others' stores visible from here


@triton.jit
def _stream(w_ptr, out_ptr, words, BLOCK: tl.constexpr, EARLY: tl.constexpr):
    wait_for_previous(EARLY)
    program = tl.program_id(0)
    total = tl.zeros([BLOCK], tl.int32)
    for first in range(program * words, (program + 1) * words, BLOCK):
        total += tl.load(w_ptr + first + tl.arange(0, BLOCK), eviction_policy="evict_first")
    tl.store(out_ptr + program, tl.sum(total, 0))


def chain_rows() -> list[dict]:
    x = torch.zeros(4096, device="cuda")
    rows = []
    for grid in (8, 132, 512, 2048):
        for early in (False, True):

            def launch(i, grid=grid, early=early):
                _touch[(grid,)](x, EARLY=early, launch_pdl=early)

            rows.append({"probe": "chain", "grid": grid, "early": early,
                         "us": round(graph_us(launch, 200), 3)})  # fmt: skip
    return rows


def barrier_rows(sms: int) -> list[dict]:
    x = torch.zeros(sms, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    times = {}
    for rounds in (1, 101):

        def launch(i, rounds=rounds):
            count.zero_()
            _barriers[(sms,)](count, x, ROUNDS=rounds, num_warps=4)

        times[rounds] = graph_us(launch, 20)
    per_barrier = (times[101] - times[1]) / 100
    return [{"probe": "barrier", "grid": sms, "us": round(per_barrier, 3)}]


def stream_rows(sms: int) -> list[dict]:
    """Each size at its best grid: a program's share rounded up to whole blocks, so a grid may
    read a little more than the size (its time is scaled back to the size's bytes). Successive
    launches read successive slices of a 1 GB pool, so each reads from memory, not from L2."""
    rows = []
    out = torch.empty(16 * sms, dtype=torch.int32, device="cuda")
    pool = torch.ones(2**30 // 4 + 16 * sms * 2048, dtype=torch.int32, device="cuda")
    for megabytes in (2, 4, 8, 16, 32, 64, 128, 512):
        words = megabytes * 2**20 // 4
        best = None
        for programs in (sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms):
            for block in (512, 1024, 2048):
                share = triton.cdiv(words, programs * block) * block

                def launch(i, programs=programs, block=block, share=share, words=words):
                    start = (i % (2**28 // words)) * words  # successive slices of the pool
                    _stream[(programs,)](
                        pool[start:], out, share, BLOCK=block, EARLY=True, launch_pdl=True
                    )

                us = graph_us(launch, 20) * words / (programs * share)
                if best is None or us < best["us"]:
                    best = {"probe": "stream", "MB": megabytes, "us": round(us, 2),
                            "programs": programs, "block": block}  # fmt: skip
        best["TB/s"] = round(megabytes * 2**20 / best["us"] / 1e6, 2)
        best["limit_us"] = round(megabytes * 2**20 / COPY_TB_S / 1e6, 2)
        rows.append(best)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = chain_rows() + barrier_rows(sms) + stream_rows(sms)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "launch_floor.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
