"""The local launcher: each stage in a subprocess on this machine, one after the other.

A stage runs as `python -m lmforge ARGV`, or under `torchrun --standalone --nproc-per-node N`
when it is a training stage with more than one process. Its output (stdout and stderr) goes to
`<stage run dir>/stage.log` and to the console, line by line, with secret values redacted.
The first failure stops the run: the stages after it are not started and their handles say
which stage failed.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TextIO

from lmforge.launch.base import (
    JobCallback,
    JobHandle,
    JobState,
    StageJob,
    job_environment,
    redact,
    torchrun_command,
)
from lmforge.procs import Terminated, die_with_parent, process_alive, raise_terminated


class LocalLauncher:
    """Runs StageJobs in subprocesses, in order, blocking until they are done.

    Args:
        python: the interpreter that runs `-m lmforge` (default: this one).
        stream: where stage output is echoed (default "stdout": sys.stdout at each write); None
            echoes nothing.
        prefix: prepend `[stage] ` to each echoed line.
    """

    name = "local"

    def __init__(
        self,
        *,
        python: str | None = None,
        stream: TextIO | str | None = "stdout",
        prefix: bool = True,
    ) -> None:
        self.python = python or sys.executable
        self._stream = stream
        self.prefix = prefix

    @property
    def stream(self) -> TextIO | None:
        """Where output is echoed now: "stdout" is whatever sys.stdout is at the time (a
        default of `sys.stdout` itself would be the one of when this module was imported)."""
        return sys.stdout if self._stream == "stdout" else self._stream

    # ------------------------------------------------------------------ interface

    def command(self, job: StageJob) -> list[str]:
        """The command line that runs `job` here."""
        if job.uses_torchrun:
            return torchrun_command(
                job.argv, nproc_per_node=job.resources.nproc_per_node, python=self.python
            )
        return job.command(self.python)

    def render(self, job: StageJob) -> dict[str, str]:
        lines = ["#!/bin/sh", f"# stage {job.name} ({job.kind}), local launcher", "set -e"]
        lines.append(f"cd {shlex.quote(str(job.workdir))}")
        for key, value in sorted(job.resources.env.items()):
            lines.append(f"export {key}={shlex.quote(value)}")
        if job.secrets:
            lines.append(f"# from the environment: {', '.join(job.secrets)}")
        lines.append(f"exec {shlex.join(self.command(job))}")
        return {"command.sh": "\n".join(lines) + "\n"}

    def submit(
        self,
        jobs: list[StageJob],
        *,
        secrets: Mapping[str, str] | None = None,
        on_event: JobCallback | None = None,
    ) -> dict[str, JobHandle]:
        secrets = dict(secrets or {})
        handles = {job.name: JobHandle(job.name, self.name, log=job.log_file) for job in jobs}
        failed: str | None = None
        for job in jobs:
            handle = handles[job.name]
            if failed is not None:
                broken = [d for d in job.depends_on if handles.get(d) and not _ok(handles[d])]
                handle.state = JobState.NOT_STARTED
                handle.reason = (
                    f"not started: stage {broken[0]!r} "
                    f"{'failed' if broken[0] == failed else 'did not run'}"
                    if broken
                    else f"not started: the run stopped after stage {failed!r} failed"
                )
                _notify(on_event, handle)
                continue
            self._run(job, handle, secrets, on_event)
            if handle.state != JobState.SUCCEEDED:
                failed = job.name
        return handles

    def wait(
        self,
        handles: dict[str, JobHandle],
        *,
        on_event: JobCallback | None = None,
        poll_s: float = 10.0,
    ) -> dict[str, JobHandle]:
        return handles  # submit() already ran everything

    def status(self, handle: JobHandle) -> JobHandle:
        # A manifest that says "running" whose process is gone was interrupted (killed with
        # the runner); one that is alive is still running.
        waiting = handle.state in (JobState.RUNNING, JobState.PENDING)
        if waiting and handle.job_id and not process_alive(int(handle.job_id)):
            handle.state = JobState.UNKNOWN
            handle.reason = f"process {handle.job_id} is gone (the run was interrupted)"
        return handle

    # ------------------------------------------------------------------ running one stage

    def _run(
        self,
        job: StageJob,
        handle: JobHandle,
        secrets: dict[str, str],
        on_event: JobCallback | None,
    ) -> None:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        env = job_environment(job, secrets)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if job.uses_torchrun:
            env.setdefault("OMP_NUM_THREADS", "1")
        command = self.command(job)
        with job.log_file.open("a", encoding="utf-8") as log:
            log.write(redact(f"+ {shlex.join(command)}\n", secrets))
            log.flush()
            try:
                process = subprocess.Popen(
                    command,
                    cwd=job.workdir,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    # a killed `lmforge run` takes its stage down (SIGTERM: training saves)
                    preexec_fn=die_with_parent,
                    # the stage's processes (torchrun and its workers) as one group, signalled
                    # as one: see _stop
                    process_group=0,
                )
            except OSError as err:
                handle.state = JobState.FAILED
                handle.reason = f"could not start {command[0]}: {err.strerror}"
                log.write(handle.reason + "\n")
                _notify(on_event, handle)
                return
            handle.job_id = str(process.pid)
            handle.state = JobState.RUNNING
            _notify(on_event, handle)
            pump = threading.Thread(
                target=self._pump, args=(process.stdout, log, job.name, secrets), daemon=True
            )
            pump.start()
            try:
                with _terminate_raises():
                    code = process.wait()
            except (KeyboardInterrupt, Terminated) as stop:
                ctrl_c = isinstance(stop, KeyboardInterrupt)
                _stop(process, signal.SIGINT if ctrl_c else signal.SIGTERM, job)
                pump.join(timeout=5)
                handle.state = JobState.CANCELLED
                handle.reason = "interrupted (Ctrl-C)" if ctrl_c else "terminated (SIGTERM)"
                handle.exit_code = process.returncode
                _notify(on_event, handle)
                raise
            pump.join()
        handle.exit_code = code
        if code == 0:
            handle.state = JobState.SUCCEEDED
            handle.reason = ""
        else:
            handle.state = JobState.FAILED
            last = _last_line(job.log_file)
            handle.reason = f"exit code {code}" + (f": {last}" if last else "")
        _notify(on_event, handle)

    def _pump(self, pipe, log: TextIO, name: str, secrets: dict[str, str]) -> None:
        # Lines end at "\n" only: a progress bar that redraws itself with "\r" (lm-eval's,
        # datasets') is one line whose last drawing is what counts, not a run of blank lines.
        lines = io.TextIOWrapper(pipe, encoding="utf-8", errors="replace", newline="\n")
        for raw in lines:
            line = redact(_last_drawing(raw), secrets)
            if not line:
                continue
            log.write(line)
            log.flush()
            stream = self.stream
            if stream is not None:
                stream.write(f"[{name}] {line}" if self.prefix else line)
                stream.flush()
        pipe.close()


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    """While a stage runs, SIGTERM to `lmforge run` (a scheduler's or `timeout`'s) raises
    `Terminated` where it waits, so that the stage is stopped and waited for (`_stop`) instead
    of left running as an orphan while the runner exits."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(process: subprocess.Popen, signum: int, job: StageJob) -> None:
    """Pass `signum` to the stage's process group (torchrun and its workers: a trainer saves
    and exits) and wait for it for the stage's grace, `launcher.signal_lead_s`; then kill the
    group. A Ctrl-C in the terminal reached only the runner: the stage has its own group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)
    try:
        process.wait(timeout=job.resources.signal_lead_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _last_drawing(line: str) -> str:
    """What a terminal would keep of `line`: its last non-blank drawing after a carriage
    return (tqdm clears a bar it does not leave with blanks), or "" when nothing is left."""
    body = line.rstrip("\n").rstrip("\r")
    ending = "\n" if line.endswith("\n") else ""
    if "\r" not in body:
        return body + ending
    drawings = [text for text in body.split("\r") if text.strip()]
    return drawings[-1] + ending if drawings else ""


def _ok(handle: JobHandle) -> bool:
    return handle.state == JobState.SUCCEEDED


def _notify(on_event: JobCallback | None, handle: JobHandle) -> None:
    if on_event is not None:
        on_event(handle)


def _last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a log (the error a failed command printed), shortened."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 8192))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."
