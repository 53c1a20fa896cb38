"""Serving: an OpenAI-compatible HTTP API (app.py) over a continuous-batching engine
(engine.py) that runs the `Generator`'s prefill and decode steps for all active sequences."""

from lmforge.serve.app import ApiError, ServeSettings, bind, create_app, serve
from lmforge.serve.engine import Engine, QueueFull, SequenceRequest, Submission, TokenOutput

__all__ = [
    "ApiError",
    "Engine",
    "QueueFull",
    "SequenceRequest",
    "ServeSettings",
    "Submission",
    "TokenOutput",
    "bind",
    "create_app",
    "serve",
]
