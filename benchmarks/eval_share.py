"""lm-eval's multiple-choice scoring with and without shared contexts (issue 57's eval row):
`questions` random questions of about `context` tokens with 4 choices of 4-12 tokens each, scored
as `lmforge eval --batch-size B` scores log-likelihood requests: by `sequence_logprobs` (each
choice with its whole question, B requests a forward: --no-share-contexts) and by
`shared_context_logprobs` (a question's choices in one row, the question once, B rows a
forward: the default). Prints requests/s of each, the ratio, and
the largest log-likelihood difference; writes eval_share.json to --out.

    python benchmarks/eval_share.py --preset llama3.2-1b --questions 256 --context 256
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from lmforge import models
from lmforge.api import build_model
from lmforge.generate.logprobs import sequence_logprobs, shared_context_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3.2-1b")
    parser.add_argument("--num-layers", type=int, help="the preset shortened to this many blocks")
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--context", type=int, default=256, help="tokens a question, about")
    parser.add_argument("--batch", type=int, default=8, help="requests (or questions) a forward")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    model_args = models.get_preset(args.preset)
    if args.num_layers:
        model_args = model_args.replace(num_layers=args.num_layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(model_args, device=args.device, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for _ in range(args.questions):
        length = int(
            torch.randint(args.context // 2, args.context * 3 // 2, (1,), generator=generator)
        )
        question = torch.randint(3, 30000, (length,), generator=generator).tolist()
        for _ in range(4):
            n = int(torch.randint(4, 13, (1,), generator=generator))
            choice = torch.randint(3, 30000, (n,), generator=generator).tolist()
            sequences.append((question + choice, n))
    rows = {}
    for name, score, batch in (
        ("each whole", sequence_logprobs, args.batch),
        ("shared contexts", shared_context_logprobs, args.batch),  # rows: questions
    ):
        score(model, sequences[: 4 * args.batch], batch_size=batch, device=args.device)  # warm up
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        results = score(model, sequences, batch_size=batch, device=args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows[name] = {
            "seconds": round(seconds, 3),
            "requests_per_s": round(len(sequences) / seconds, 1),
        }
        rows[name]["results"] = results
    a, b = (rows[name].pop("results") for name in ("each whole", "shared contexts"))
    difference = max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True))
    flags = sum(x[1] != y[1] for x, y in zip(a, b, strict=True))
    ratio = rows["shared contexts"]["requests_per_s"] / rows["each whole"]["requests_per_s"]
    record = {
        "preset": args.preset, "num_layers": args.num_layers, "questions": args.questions,
        "context": args.context, "batch": args.batch, "rows": rows, "speedup": round(ratio, 2),
        "max_loglikelihood_difference": difference, "greedy_flags_differing": flags,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval_share.json").write_text(json.dumps(record, indent=2) + "\n")
    for name, row in rows.items():
        print(f"{name}: {row['requests_per_s']} requests/s ({row['seconds']} s)")
    print(f"shared over whole: {ratio:.2f}x; largest difference {difference:.2e}, "
          f"{flags} greedy flags differ")  # fmt: skip


if __name__ == "__main__":
    main()
