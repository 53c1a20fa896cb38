"""Whether a Generator's GPU memory comes back once it is dropped: builds, warms up and runs
a compiled Generator over a preset twice in one process, and after each prints the memory
still allocated, whether the model and the engine were collected, and what refers to them if
not (docs/benchmarks.md: decode.py's later variants peaked higher than its first).

    python3 benchmarks/engine_release.py --preset llama3.2-1b --scheme int8-wo
"""

from __future__ import annotations

import argparse
import gc
import weakref

import torch

from benchmarks.decode import SCHEMES, make_model
from lmforge.generate import Generator, SamplingParams


def allocated_gb() -> float:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 1e9


def referrers(obj, depth: int = 3, seen: set | None = None, indent: str = "  ") -> None:
    """Print what refers to `obj`, `depth` levels up (types and a short repr)."""
    seen = seen if seen is not None else {id(obj)}
    if depth == 0:
        return
    for ref in gc.get_referrers(obj):
        if id(ref) in seen or type(ref).__name__ == "frame":
            continue
        seen.add(id(ref))
        print(f"{indent}{type(ref).__module__}.{type(ref).__qualname__}: {repr(ref)[:120]}")
        referrers(ref, depth - 1, seen, indent + "  ")


def live_cuda_tensors(least_bytes: int = 1 << 20) -> tuple[int, float]:
    """Python-visible CUDA tensors of real storage (not dynamo's fake ones) of at least that."""
    from torch._subclasses.fake_tensor import FakeTensor

    found = [
        o
        for o in gc.get_objects()
        if torch.is_tensor(o) and not isinstance(o, FakeTensor) and o.is_cuda
        if o.nbytes >= least_bytes
    ]
    return len(found), sum(t.nbytes for t in found) / 1e9


def allocated_blocks(top: int = 8) -> None:
    """The largest blocks still allocated, with where each was allocated (the allocator's
    recorded history: `_record_memory_history` at the start)."""
    blocks = [
        (block["size"], block.get("frames", []))
        for segment in torch.cuda.memory._snapshot()["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    ]
    blocks.sort(key=lambda b: -b[0])
    print(f"  {len(blocks)} blocks allocated, {sum(b[0] for b in blocks) / 1e9:.3f} GB; largest:")
    for size, frames in blocks[:top]:
        ours = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames]
        ours = [f for f in ours if not f.startswith(("<", "__init__.py"))][:6]
        print(f"    {size / 1e6:.1f} MB: " + " <- ".join(ours))


@torch.no_grad()
def run_once(preset: str, scheme: str, tokens: int) -> tuple[weakref.ref, weakref.ref]:
    model = make_model(preset, scheme)
    generator = Generator(model, max_batch=1, max_seq_len=16 + tokens, device="cuda")
    generator.warmup()
    params = SamplingParams(max_new_tokens=tokens, temperature=0, stop_token_ids=())
    generator.generate([list(range(1, 17))], params)
    print(f"  with the generator: {allocated_gb():.3f} GB allocated", flush=True)
    return weakref.ref(model), weakref.ref(generator.engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--scheme", default="int8-wo", choices=sorted(SCHEMES))
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    print(f"before: {allocated_gb():.3f} GB allocated", flush=True)
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}", flush=True)
        model, engine = run_once(args.preset, args.scheme, args.tokens)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        count, size = live_cuda_tensors()
        print(
            f"  dropped: {allocated_gb():.3f} GB allocated, {count} CUDA tensors >= 1 MB "
            f"({size:.3f} GB) alive; model alive {model() is not None}, "
            f"engine alive {engine() is not None}",
            flush=True,
        )
        allocated_blocks()
        for name, ref in (("model", model), ("engine", engine)):
            if ref() is not None:
                print(f"  what refers to the {name}:")
                referrers(ref())


if __name__ == "__main__":
    main()
