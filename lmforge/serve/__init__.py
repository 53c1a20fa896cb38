"""Serving: an OpenAI-compatible HTTP API over a continuous-batching engine (engine.py) that runs
the `Generator`'s prefill and decode steps for all active sequences.

By layer: protocol.py (limits, request bodies, the error envelope), middleware.py (metrics, API
key, body limit), tools.py (tool calls: the tools in the chat template, the grammar of a forced
call, calls read out of the text), session.py (a request's run through the engine, JSON and
server-sent events), app.py (the FastAPI app and its routes), server.py (uvicorn with a SIGTERM
drain), frontend.py (HTTP in a process of its own, the engine loop in the main process:
`lmforge serve`'s way)."""

from lmforge.serve.app import create_app
from lmforge.serve.engine import (
    Engine,
    QueueFull,
    SequenceRequest,
    Submission,
    ThreadChannel,
    TokenOutput,
)
from lmforge.serve.protocol import ApiError, ServeSettings
from lmforge.serve.server import bind, serve
from lmforge.serve.session import ServedModel

__all__ = [
    "ApiError",
    "Engine",
    "QueueFull",
    "SequenceRequest",
    "ServeSettings",
    "ServedModel",
    "Submission",
    "ThreadChannel",
    "TokenOutput",
    "bind",
    "create_app",
    "serve",
]
