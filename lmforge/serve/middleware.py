"""What wraps every route: Prometheus metrics, the API key check and the request-body limits
(ASGI middlewares, so that they also see the 401s, 408s and 413s they answer themselves)."""

from __future__ import annotations

import asyncio
import gc
import hmac
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lmforge.serve.protocol import ApiError, error_response

# ---- metrics --------------------------------------------------------------------------------

ROUTES = (
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
)


class Metrics:
    """The server's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lmforge_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "lmforge_request_latency_seconds",
            "Time from a request's arrival to its last byte",
            ["route"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.first_token = Histogram(
            "lmforge_time_to_first_token_seconds",
            "Time from a generation request's arrival to its first token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "lmforge_prompt_tokens", "Prompt tokens of admitted sequences", registry=r
        )
        self.prefix_cache_hits = Counter(
            "lmforge_prefix_cache_hits",
            "Prompt tokens taken from the prefix cache instead of prefilled (the hit rate: over "
            "lmforge_prompt_tokens)",
            registry=r,
        )
        self.generation_tokens = Counter(
            "lmforge_generation_tokens", "Tokens generated", registry=r
        )
        self.finished = Counter(
            "lmforge_sequences_finished",
            "Sequences that left the engine, by reason",
            ["reason"],
            registry=r,
        )
        self.batch_size = Histogram(
            "lmforge_batch_size",
            "Sequences advanced by one engine step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.step_seconds = Histogram(
            "lmforge_engine_step_seconds",
            "Time of one engine step (admit, decode or prefill, tokens to the host)",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.queue_depth = Gauge(
            "lmforge_queue_depth", "Sequences waiting for a free row", registry=r
        )
        self.running = Gauge("lmforge_running_sequences", "Sequences being decoded", registry=r)
        self.gc_pause = Histogram(
            "lmforge_gc_pause_seconds",
            "Python garbage collections: every thread waits while one runs",
            ["generation"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )

    def watch_gc(self) -> Callable[[], None]:
        """Time every garbage collection into `gc_pause` from now on; returns the function
        that stops it."""
        started = [0.0]

        def callback(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                generation = str(info["generation"])
                self.gc_pause.labels(generation).observe(time.perf_counter() - started[0])

        gc.callbacks.append(callback)
        return lambda: gc.callbacks.remove(callback)

    def on_step(self, num_advanced: int, seconds: float) -> None:
        self.batch_size.observe(num_advanced)
        self.step_seconds.observe(seconds)

    def on_finish(self, reason: str, num_tokens: int) -> None:
        self.finished.labels(reason).inc()
        self.generation_tokens.inc(num_tokens)


class MetricsMiddleware:
    """Counts every HTTP request by route and status and times it to its last byte."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)


class AuthMiddleware:
    """With an API key: `Authorization: Bearer <key>` on every route but /health, else 401."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health" or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = ApiError(
            401,
            "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error_response(err)(scope, receive, send)

    def _authorized(self, scope) -> bool:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        # Constant time in the key: the comparison does not stop at the first wrong byte.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: at once when Content-Length says so, else as soon as
    the bytes received pass it (chunked uploads); 408 (and the connection closed) for a body
    not whole within `timeout` seconds. Bodies within both are read here and replayed."""

    def __init__(self, app, limit: int, timeout: float) -> None:
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared and declared[0].strip().isdigit() and int(declared[0]) > self.limit:
            await error_response(self._too_large())(scope, receive, send)
            return
        messages, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                await error_response(self._too_slow())(scope, receive, send)
                return
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await error_response(self._too_large())(scope, receive, send)
                return
            if not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _too_slow(self) -> ApiError:
        return ApiError(
            408,
            f"the request body did not arrive within {self.timeout:g} s (lmforge serve "
            "--body-timeout)",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body may still come: not ours
        )

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"the request body is larger than this server's limit of {self.limit} bytes "
            "(lmforge serve --max-request-bytes)",
            code="request_too_large",
        )
