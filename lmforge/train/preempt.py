"""Preemption: a signal sets a flag; the loop acts on it at the next step boundary.

Slurm sends the configured signal ahead of the kill (`--signal=B:USR2@120`), Kubernetes and
torchrun send SIGTERM. The handler only sets a flag; the training loop combines it across ranks
(in the per-step all-reduce it does anyway), so every rank stops after the same step, saves a
checkpoint synchronously and exits with `PREEMPTED_EXIT_CODE`; rerunning the same command
resumes from that checkpoint.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again"; never 0, so Slurm's afterok waits


class PreemptionWatch:
    """The CLI process's preemption handlers (SIGTERM and `train.preempt_signal`), installed for
    a `with` block (`lmforge pretrain|sft|dpo|grpo`). The loop reads `active_watch()`: a
    library caller (a test, a notebook) keeps its own signal handlers, so Ctrl-C and SIGTERM
    stop it as they would anything else."""

    def __init__(self, signal_name: str = "SIGTERM") -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._names = {"SIGTERM", signal_name}
        self._previous: dict = {}

    def __enter__(self) -> PreemptionWatch:
        global _ACTIVE
        for name in self._names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)
        _ACTIVE = self
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        _ACTIVE = None

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        if not self.requested:
            log.warning(
                "received %s: will save a checkpoint and stop after this step", self.signal_name
            )
        self.requested = True


_ACTIVE: PreemptionWatch | None = None


def active_watch() -> PreemptionWatch:
    """The watch the CLI installed, else one that no signal sets (handlers stay the caller's)."""
    return _ACTIVE or PreemptionWatch()


class PreemptedError(Exception):
    """Raised by the loop after the preemption checkpoint was committed."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, step: int, signal_name: str | None) -> None:
        super().__init__(
            f"preempted by {signal_name or 'a signal'}: saved step {step}; rerun the same command "
            "to resume"
        )
        self.step = step
