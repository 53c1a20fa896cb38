"""Progress of long loops for people watching a terminal and for logs.

On a terminal, `Progress` is a tqdm bar. Anywhere else (a pipe, a pipeline's stage log, a
Slurm output file), a redrawn bar would arrive as `\\r`-separated fragments, so it writes one
plain line every `PLAIN_EVERY_S` seconds and one when it finishes:
`loglikelihood: 1,200/4,800 requests (25%), 0:35 elapsed, ~1:45 left`.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

PLAIN_EVERY_S = 15.0
"""Seconds between plain progress lines (not on a terminal)."""


class Progress:
    """Counts `total` units of work (a context manager; `update(n)` as they finish).

    Args:
        total: units of work in all.
        desc: what is being done, the line's first word(s).
        unit: the plural name of a unit.
        disable: show nothing at all (e.g. on a rank other than 0, or lm-eval's disable_tqdm).
        file: where to write (default: stderr); a terminal gets a bar, anything else lines.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        unit: str = "items",
        disable: bool = False,
        file: TextIO | None = None,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.file = file if file is not None else sys.stderr
        self.done = 0
        self._start = self._last_line = time.monotonic()
        self._plain = not disable and not _is_terminal(self.file)
        self._bar = None
        if not disable and not self._plain:
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=self.file, dynamic_ncols=True, leave=True
            )

    def update(self, count: int = 1) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self._plain and time.monotonic() - self._last_line >= PLAIN_EVERY_S:
            self._write_line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._plain and self.done:
            self._write_line()
            self._plain = False  # once

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_line(self) -> None:
        now = time.monotonic()
        self._last_line = now
        elapsed = now - self._start
        text = f"{self.desc}: {self.done:,}/{self.total:,} {self.unit}"
        if self.total:
            text += f" ({100 * self.done / self.total:.0f}%)"
        text += f", {_clock(elapsed)} elapsed"
        if 0 < self.done < self.total:
            text += f", ~{_clock(elapsed / self.done * (self.total - self.done))} left"
        print(text, file=self.file, flush=True)


def _is_terminal(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _clock(seconds: float) -> str:
    """H:MM:SS above an hour, else M:SS."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
