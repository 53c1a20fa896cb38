"""HTTP in a process of its own: `lmforge serve` runs the engine loop in its main process (where
the model is, and under tensor parallelism the process group) and FastAPI + uvicorn in a child
process (`python -m lmforge.serve.frontend`), the two joined by a pipe.

Why: in one process the event loop (HTTP parsing and writing, JSON, the requests' coroutines)
and the engine thread (launching steps, detokenizing, stop checks) take turns on one GIL; at 64
streams each held it about half the time, so the GPU waited for Python. Apart, each has an
interpreter of its own and the pipe carries only ops one way (add a sequence, cancel one) and
each step's tokens the other (engine.py's message format). 1B on an H200, 64 streams: 25.2k
tokens/s in one process, 32.4k in two (docs/benchmarks.md, session 11).

Lifecycle: the main process binds the socket, loads and warms the model, then starts the HTTP
process with the socket and its end of the pipe (inherited file descriptors) and sends it the
tokenizer and settings. SIGTERM to the main process is passed on: the HTTP process drains
(server.py), tells the engine loop to stop and exits; the main process then exits with its
code. Ctrl+C reaches both from the terminal: the HTTP process drains, the main process waits
for it. If either process dies, the other sees the pipe close and ends too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe

from lmforge.procs import die_with_parent, leave_now
from lmforge.serve.engine import run_engine


class PipeChannel:
    """The front end's end of the pipe (the HTTP process): `Engine`'s channel."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._alive = False
        self._closing = False
        self._deliver: Callable[[tuple], None] | None = None
        self._stopped: asyncio.Future | None = None

    @property
    def alive(self) -> bool:
        return self._alive

    def start(self, deliver: Callable[[tuple], None]) -> None:
        loop = asyncio.get_running_loop()
        self._deliver = deliver
        self._stopped = loop.create_future()
        self._alive = True
        loop.add_reader(self.connection.fileno(), self._read)

    def _read(self) -> None:
        """Every message that has arrived, to the front end (on the event loop)."""
        try:
            while self.connection.poll():
                message = self.connection.recv()
                if message[0] == "stopped":
                    self._end()
                    if not self._closing:  # a failure it could not serve past
                        os.kill(os.getpid(), signal.SIGTERM)
                    return
                self._deliver(message)
        except (EOFError, OSError):  # the engine's process is gone
            self._end()
            self._deliver(("failed", "the engine's process exited; the HTTP process stops too"))
            os.kill(os.getpid(), signal.SIGTERM)  # nothing to serve with

    def _end(self) -> None:
        if self._alive:
            self._alive = False
            asyncio.get_running_loop().remove_reader(self.connection.fileno())
            self._stopped.set_result(None)

    def send(self, ops: list[tuple]) -> None:
        with contextlib.suppress(OSError):  # the engine's process is gone: _read says so
            self.connection.send(ops)

    async def close(self) -> None:
        """Ask the engine loop to stop and wait until it has."""
        if self._alive:
            self._closing = True
            self.send(None)
            await self._stopped


class PipeEnd:
    """The engine loop's end of the pipe (the main process): `run_engine`'s channel."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.closed = False

    def take(self, wait: bool, timeout: float | None) -> list[tuple] | None:
        """The ops that arrived (waiting up to `timeout` for some when `wait`); None once the
        front end said stop or is gone."""
        if self.closed:
            return None
        ops: list[tuple] = []
        try:
            if wait and not self.connection.poll(timeout):
                return ops
            while self.connection.poll():
                message = self.connection.recv()
                if message is None:
                    self.closed = True
                    return None
                ops += message
        except (EOFError, OSError):
            self.closed = True
            return None
        return ops

    def post(self, message: tuple) -> None:
        try:
            self.connection.send(message)
        except OSError:  # the HTTP process is gone: take() says stop next
            self.closed = True


def serve_in_two_processes(
    core,
    model,
    settings,
    sock: socket.socket,
    *,
    mirror: Callable[[list[tuple], str], None] | None = None,
    **serve_options,
) -> int:
    """Run the HTTP process over `sock` and the engine loop over `core` here until the HTTP
    process stops it; returns the HTTP process's exit code. `model` (a `ServedModel`),
    `settings` (`ServeSettings`) and `serve_options` (server.py's `serve` keywords) go to the
    HTTP process; `mirror`: see engine.py (tensor parallelism, rank 0)."""
    ours, theirs = Pipe()
    command = [sys.executable, "-m", "lmforge.serve.frontend"]
    command += [str(theirs.fileno()), str(sock.fileno())]
    process = subprocess.Popen(
        command, pass_fds=(theirs.fileno(), sock.fileno()), preexec_fn=die_with_parent
    )
    theirs.close()
    sock.close()  # the HTTP process's copy is the one that listens (and closes on SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl+C reaches it directly
    channel = PipeEnd(ours)
    try:
        channel.post((model, settings, serve_options))
        run_engine(core, channel, mirror)
        channel.post(("stopped",))
    finally:
        ours.close()
    code = process.wait()
    if code != 0:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
        print(f"error: the HTTP process {how}; the engine stops too", file=sys.stderr, flush=True)
    return code


def main(argv: list[str]) -> int:
    """The HTTP process: argv = [pipe fd, socket fd] (see `serve_in_two_processes`)."""
    from lmforge.serve.app import create_app
    from lmforge.serve.server import serve

    connection = Connection(int(argv[0]))
    sock = socket.socket(fileno=int(argv[1]))
    model, settings, serve_options = connection.recv()
    app = create_app(model, settings, PipeChannel(connection))
    gc.collect()
    gc.freeze()  # what exists now lives as long as the server (see commands/serve.py)
    return 0 if serve(app, sock, **serve_options) else 1


if __name__ == "__main__":
    leave_now(main(sys.argv[1:]))
