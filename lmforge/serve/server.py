"""Running the app: `bind` a listening socket, then `serve(app, sock)` under uvicorn until
SIGTERM/SIGINT, draining in-flight requests for a grace period."""

from __future__ import annotations

import asyncio
import signal
import socket

import uvicorn
from fastapi import FastAPI

from lmforge.errors import UserError


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end with exit code 0 after the drain
    (uvicorn records the signal and raises it again once it has shut down), and requests
    still running when the grace period ends get an OpenAI-style 503 (a last error event for
    streams) rather than uvicorn's plain-text 500."""

    def __init__(self, config: uvicorn.Config, engine, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting
            return
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(
                self.loop.call_later, self.grace, self.engine.shut_down_sessions
            )
        self.should_exit = True


def serve(
    app: FastAPI,
    sock: socket.socket,
    *,
    shutdown_grace: float = 30.0,
    log_level: str = "info",
    access_log: bool = False,
) -> bool:
    """Serve until SIGTERM/SIGINT: then stop accepting connections, let in-flight requests
    finish for up to `shutdown_grace` seconds (cancel the rest), stop the engine and return.
    Returns False if the app failed to start."""
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        # past the grace period the sessions answer 503 themselves; uvicorn cancels what is
        # left a little later
        timeout_graceful_shutdown=shutdown_grace + 2.0,
        lifespan="on",
    )
    server = _DrainingServer(config, app.state.engine, shutdown_grace)
    server.run(sockets=[sock])
    return bool(server.started)
