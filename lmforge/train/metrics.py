"""Training metrics: throughput and MFU arithmetic, and the sinks they go to.

Every logging step goes to `<run_dir>/metrics.jsonl` (one JSON object per line), to TensorBoard
(`<run_dir>/tensorboard`), to Weights & Biases when configured (offline mode needs no network),
and to the console through a tqdm progress bar. Only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from lmforge.train.config import MetricsSection

log = logging.getLogger(__name__)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # ru_maxrss is in KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class Throughput:
    """Tokens/s and MFU over the window since the last call."""

    def __init__(self, *, flops_per_token: float, peak_flops: float, num_devices: int) -> None:
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.num_devices = num_devices
        self._time = time.perf_counter()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def reset(self) -> None:
        self._time, self._tokens = time.perf_counter(), 0

    def measure(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._time, 1e-9)
        tokens_per_s = self._tokens / elapsed
        mfu = tokens_per_s * self.flops_per_token / (self.peak_flops * self.num_devices)
        self.reset()
        return {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.num_devices,
            "mfu": mfu,
        }


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        cfg: MetricsSection,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        job_config: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self._tb = self._wandb = None
        self._bar = None
        self._start_time = time.perf_counter()
        self._start_step = start_step
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        _drop_rows_after(run_dir / "metrics.jsonl", start_step)
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                log.warning("metrics.tensorboard = true but the tensorboard package is missing")
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                from lmforge.errors import ConfigError

                raise ConfigError(
                    "metrics.wandb = true needs the wandb package: pip install wandb"
                ) from None
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                mode=cfg.wandb_mode,
                dir=str(run_dir),
                config=job_config or {},
                resume="allow",
                id=run_dir.name,
            )
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=None,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        done = step - self._start_step
        elapsed = time.perf_counter() - self._start_time
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}, "eta_s": round(eta, 1)}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(f"train/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self._bar is None:
            return
        if self._bar.disable:  # not a terminal (a log file, Slurm): one line per log step
            print(_console_line(record), file=sys.stderr, flush=True)
        else:
            extra = {"reward": f"{record['reward']:.3f}"} if "reward" in record else {}
            if "expert_load_max_mean" in record:  # MoE: the worst layer's max / mean load
                extra["load"] = f"{record['expert_load_max_mean']:.2f}"
            self._bar.set_postfix(
                loss=f"{record.get('loss', float('nan')):.4f}",
                **extra,  # GRPO's rollouts
                tok_s=f"{record.get('tokens_per_s', 0):.0f}",
                mfu=f"{100 * record.get('mfu', 0):.1f}%",
                refresh=False,
            )

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _drop_rows_after(path: Path, step: int) -> None:
    """Forget the rows of steps a crash undid (the resumed run logs them again), so every step
    appears once; rewritten atomically."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _logged_step(line) <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    log.info("%s: dropped %d rows logged after step %d", path, len(lines) - len(kept), step)


def _logged_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a torn last line from a kill: dropped


def _plain(value):
    # Full precision: resume tests compare logged losses bit for bit.
    return value.item() if isinstance(value, torch.Tensor) else value


def _console_line(record: dict) -> str:
    return (
        f"step {record['step']}: loss {record.get('loss', float('nan')):.4f}, "
        f"lr {record.get('lr', 0):.2e}, grad_norm {record.get('grad_norm', 0):.3f}, "
        f"{record.get('tokens_per_s', 0):,.0f} tok/s, mfu {100 * record.get('mfu', 0):.1f}%, "
        f"peak mem {record.get('peak_mem_gb', 0):.2f} GB, eta {record.get('eta_s', 0):.0f}s"
        + (f", val_loss {record['val_loss']:.4f}" if "val_loss" in record else "")
        + (f", reward {record['reward']:.4f}" if "reward" in record else "")
        + (
            f", expert load max/mean {record['expert_load_max_mean']:.2f}"
            if "expert_load_max_mean" in record
            else ""
        )
    )
