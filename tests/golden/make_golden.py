"""Produce tests/golden/tiny_pretrain_losses.json: the first 20 losses of the `tiny` preset
(fixed seed, generated corpus, deterministic mode, fp32 CPU, one process).

Run: .venv/bin/python -m tests.golden.make_golden

How far these values move between processors (float summation order follows vector widths and
BLAS kernels), measured against the checked-in file:
- 2026-11-30, a 2-core AMD EPYC with AVX-512 (issue 18): up to 2.4e-5 relative.
- 2026-11-30, a 2-core AMD EPYC (AVX2), the same run with ATen's kernels forced to scalar code
  (`ATEN_CPU_CAPABILITY=default`, as on a processor without AVX2): up to 1.5e-5 relative, from
  step 9 on (steps 1-8 within 6e-7); `MKL_CBWR=COMPATIBLE` (MKL's portable kernels): 6.4e-6;
  1 or 2 threads, `MKL_ENABLE_INSTRUCTIONS=SSE4_2|AVX`, `ONEDNN_MAX_CPU_ISA=SSE41`: identical.
The test allows 8x the largest of these (2e-4), which still catches small real changes
(measured the same day): the learning rate 1% higher fails at step 2 (16% off by step 20),
one more warm-up step at step 2, weight decay 0.10 -> 0.11 at step 9 (1.4e-3).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.train_utils import losses, make_shards, run_inprocess

OUT = Path(__file__).parent / "tiny_pretrain_losses.json"
CROSS_MACHINE_RTOL = 2e-4  # 8x the largest spread measured between processors (see above)


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
