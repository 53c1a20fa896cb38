"""torch.profiler traces for a window of steps, and CUDA memory snapshots on request.

Traces go to `<run_dir>/profile/` (open them in Perfetto or TensorBoard); the memory snapshot
to `<run_dir>/profile/memory-rankN.pickle` (open it at pytorch.org/memory_viz).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lmforge.train.config import ProfileSection

log = logging.getLogger(__name__)


class Profiler:
    def __init__(self, cfg: ProfileSection, run_dir: Path, layout) -> None:
        self.cfg, self.layout = cfg, layout
        self.out_dir = run_dir / "profile"
        self._profile = None
        self._snapshot = cfg.enabled and cfg.memory_snapshot and layout.device.type == "cuda"
        self._end_step = cfg.start_step + cfg.num_steps - 1

    def __enter__(self):
        if not self.cfg.enabled:
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.layout.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # Steps are counted from the profiler's start: wait until start_step, then record.
        schedule = torch.profiler.schedule(
            wait=max(self.cfg.start_step - 2, 0), warmup=1, active=self.cfg.num_steps, repeat=1
        )
        self._profile = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.out_dir), worker_name=f"rank{self.layout.rank}"
            ),
            record_shapes=True,
            with_stack=False,
        )
        self._profile.__enter__()
        if self._snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        return self

    def step(self, step: int) -> None:
        if self._profile is not None:
            self._profile.step()
        if self._snapshot and step == self._end_step:
            path = self.out_dir / f"memory-rank{self.layout.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._snapshot = False
            log.info("wrote CUDA memory snapshot %s", path)

    def __exit__(self, *exc) -> None:
        if self._profile is not None:
            self._profile.__exit__(*exc)
            self._profile = None
