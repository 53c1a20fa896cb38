"""Produce tests/golden/tiny_pretrain_losses.json: the first 20 losses of the `tiny` preset
(fixed seed, generated corpus, deterministic mode, fp32 CPU, one process).

Run: .venv/bin/python -m tests.golden.make_golden
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.train_utils import losses, make_shards, run_inprocess

OUT = Path(__file__).parent / "tiny_pretrain_losses.json"


def golden_run(root: Path) -> dict[str, float]:
    tokenizer, shards = make_shards(root / "data")
    run_dir = root / "run"
    args = [
        f"run_dir={run_dir}",
        f"data.shards={shards}",
        f"model.tokenizer={tokenizer}",
        "model.source=tiny",
        "data.seq_len=64",
        "train.micro_batch_size=2",
        "train.steps=20",
        "train.seed=1234",
        "train.deterministic=true",
        "scheduler.warmup_steps=5",
        "optim.lr=3e-3",
        "metrics.log_every=1",
        "metrics.tensorboard=false",
        "checkpoint.every=0",
    ]
    assert run_inprocess("pretrain", args) == 0
    return {str(step): loss for step, loss in sorted(losses(run_dir).items())}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        values = golden_run(Path(tmp))
    OUT.write_text(json.dumps({"preset": "tiny", "losses": values}, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)
