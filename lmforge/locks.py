"""One writer a run directory.

A training run (`pretrain`, `sft`, `dpo`) and a pipeline run (`lmforge run`) each write files
that a second writer in the same directory would delete or interleave (metrics.jsonl,
checkpoints, stage directories). The writer holds an exclusive `flock` on
`<directory>/.lmforge.lock` while it works. The lock belongs to the open file, so the kernel
releases it when the process ends, however it ends (SIGKILL, a lost node, a Slurm requeue):
the file a killed run leaves behind locks nothing, and a rerun proceeds. The file's text
names the holder, for the refusal's message. Only the process that writes takes it (rank 0
of a distributed run).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lmforge.errors import UserError

LOCK_NAME = ".lmforge.lock"


class DirectoryInUseError(UserError):
    """Another process writes the directory now."""


@contextmanager
def one_writer(directory: str | Path) -> Iterator[None]:
    """Hold `directory`'s writer lock for the body (creating the directory), or raise
    `DirectoryInUseError` naming the process that holds it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip()
            raise DirectoryInUseError(
                f"{directory} is in use by {holder or 'another process'}; one writer at a "
                "time: wait for it to end or stop it (a killed run holds nothing)"
            ) from None
        os.ftruncate(fd, 0)
        command = " ".join(["lmforge", *sys.argv[1:]])[:200]
        holder = f"pid {os.getpid()} on {socket.gethostname()} ({command})"
        os.pwrite(fd, holder.encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
