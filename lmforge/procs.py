"""Child processes that do not outlive their parent.

A parent killed with SIGKILL runs no cleanup, so its children (prepare's tokenizer workers, a
pipeline stage started by `lmforge run`) would go on as orphans: holding memory, writing into
a run nobody records. On Linux the kernel can signal a child when its parent thread dies
(prctl PR_SET_PDEATHSIG); elsewhere this is a no-op. Also here, below the command line and
the server that both call it: `leave_now`, a process's exit once its work is flushed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, *, parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (call it in the
    child: a Popen `preexec_fn`, a pool initializer). `parent`: the pid the parent had (a
    child that starts slowly may find it already gone); default: the current parent."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid() if parent is None else parent
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True


class Terminated(BaseException):
    """SIGTERM reached a process that passes it on to its children and waits for them (`lmforge
    run`'s local launcher); the command then exits with 128 + SIGTERM, as the signal would."""

    exit_code = 128 + signal.SIGTERM


def raise_terminated(signum, frame) -> None:
    """A SIGTERM handler: `Terminated` in the main thread, where the process waits."""
    raise Terminated()


def leave_now(code: int) -> None:
    """Leave, once the work is done and flushed, without running finalizers or C++
    destructors: a finished gloo rank of torchrun was seen to abort while tearing down
    ("terminate called without an active exception", SIGABRT), which torchrun and Slurm then
    report as a failed job; a server (`exit_fast`) would print Triton's leak reports."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
