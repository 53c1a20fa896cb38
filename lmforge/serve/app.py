"""The OpenAI-compatible HTTP API: request and response models, errors, auth, metrics, routes.

`create_app(generator, settings)` builds the FastAPI app around an `Engine` (continuous
batching, engine.py) started and stopped with the app's lifespan; `serve(app, ...)` runs it
under uvicorn with a SIGTERM drain. Routes: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (both also as server-sent events with `"stream": true`, ending with
`data: [DONE]`), `GET /health` (never behind the API key) and `GET /metrics` (Prometheus text).

The contract for bad input: every client mistake is a 4xx with OpenAI's envelope
`{"error": {"message", "type", "param", "code"}}` naming the parameter at fault; never a 5xx.
Request bodies are validated strictly (wrong types are not coerced, unknown keys are refused,
as OpenAI does); a malformed body, a value out of range, a prompt plus `max_tokens` beyond the
context, or `n` above the limit is a 400; an unknown model a 404; a missing or wrong
`Authorization: Bearer` key a 401 (compared in constant time); a full queue a 429 with
`Retry-After`; a request past its timeout a 408. A client that disconnects frees its rows at
the next engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmforge.errors import UserError
from lmforge.generate import Generator, SamplingParams
from lmforge.serve.engine import Engine, QueueFull, SequenceRequest, TokenOutput

logger = logging.getLogger("lmforge.serve")

MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHAT_TOP_LOGPROBS = 20  # and for /v1/chat/completions


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """How the server behaves (the model and its cache are the `Generator`'s).

    Args:
        model_name: the name clients pass as "model" (and /v1/models lists).
        api_key: when set, every route but /health needs `Authorization: Bearer <api_key>`.
        max_queue: sequences that may wait for a free row (beyond the generator's max_batch,
            which run at once); more get a 429.
        max_n: the most choices one request may ask for (`n`, times the prompts of a
            completion request).
        request_timeout: seconds from arrival to the last token (queueing included); None or 0
            for no limit.
        retry_after: seconds a 429 asks the client to wait.
        max_request_bytes: larger request bodies get a 413 before they are read.
    """

    model_name: str
    api_key: str | None = None
    max_queue: int = 64
    max_n: int = 8
    request_timeout: float | None = 600.0
    retry_after: int = 1
    max_request_bytes: int = 8 << 20


# ---- errors ---------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered with OpenAI's envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers


def error_body(message: str, *, type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(err: ApiError) -> JSONResponse:
    body = error_body(err.message, type=err.type, param=err.param, code=err.code)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def _param_name(loc: tuple) -> str | None:
    """'messages[0].content' from pydantic's ('body', 'messages', 0, 'content', 'str')."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif _FIELD_NAME.match(part) and part not in _TYPE_NAMES:  # not a union member's tag
            name += f".{part}" if name else part
    return name or None


def _is_type_error(error: dict) -> bool:
    return error.get("type", "").endswith(("_type", "_parsing"))


def _validation_error(errors: list[dict], *, json_body: bool = True) -> ApiError:
    """One 400 from FastAPI's validation errors: the deepest error names the parameter."""
    if not errors:
        return ApiError(400, "invalid request body", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(
            400,
            f"the request body is not valid JSON ({detail})" if detail else "invalid JSON body",
            code="invalid_json",
        )

    # Of a union's errors, the deepest names the parameter, and a wrong value says more than a
    # wrong type (it comes from the member whose type matched).
    def rank(error: dict) -> tuple[int, bool]:
        depth = len([p for p in error["loc"] if _param_name((p,))])
        return depth, not _is_type_error(error)

    deepest = max(errors, key=rank)
    param = _param_name(deepest["loc"])
    if param is None:
        message = "the request body must be a JSON object"
        if not json_body:
            message += " sent with the header 'Content-Type: application/json'"
        return ApiError(400, message, code="invalid_request")
    kind = deepest.get("type", "")
    if kind == "missing":
        return ApiError(400, f"missing required parameter '{param}'", param=param, code="missing")
    if kind == "extra_forbidden":
        return ApiError(
            400,
            f"unrecognized request argument '{param}' (not supported by this server)",
            param=param,
            code="unknown_parameter",
        )
    same = [deepest]
    if _is_type_error(deepest):  # every member's type was wrong: list them all
        same = [e for e in errors if _param_name(e["loc"]) == param and _is_type_error(e)]
    messages = [e.get("msg", "invalid").removeprefix("Value error, ") for e in same]
    messages = list(dict.fromkeys(messages))
    got = json.dumps(deepest.get("input"), default=str)
    got = got if len(got) <= 60 else got[:57] + "..."
    code = "invalid_type" if _is_type_error(deepest) else "invalid_value"
    return ApiError(
        400, f"invalid '{param}': {'; or '.join(messages)} (got {got})", param=param, code=code
    )


# ---- request models -------------------------------------------------------------------------


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
Float = Annotated[float, Field(allow_inf_nan=False)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
StopStrings = NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)]


class _Strict(BaseModel):
    # Wrong types are errors, not coerced; unknown keys are refused (as OpenAI does).
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's extension; -1 or 0: no limit
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopStrings | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Float] | None = None
    user: Text | None = None
    ignore_eos: bool | None = None  # vLLM's extension: generate exactly max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: Text | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "ipython"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None


# ---- metrics --------------------------------------------------------------------------------

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


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
        self.queue_depth = Gauge(
            "lmforge_queue_depth", "Sequences waiting for a free row", registry=r
        )
        self.running = Gauge("lmforge_running_sequences", "Sequences being decoded", registry=r)

    def on_finish(self, reason: str, num_tokens: int) -> None:
        self.finished.labels(reason).inc()
        self.generation_tokens.inc(num_tokens)


class _MetricsMiddleware:
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


class _AuthMiddleware:
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
        await _error_response(err)(scope, receive, send)

    def _authorized(self, scope) -> bool:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        # Constant time in the key: the comparison does not stop at the first wrong byte.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


class _BodyLimitMiddleware:
    """413 for a body over `limit` bytes: at once when Content-Length says so, else as soon as
    the bytes received pass it (chunked uploads). Smaller bodies are read here and replayed."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared and declared[0].strip().isdigit() and int(declared[0]) > self.limit:
            await _error_response(self._too_large())(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await _error_response(self._too_large())(scope, receive, send)
                return
            if not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"the request body is larger than this server's limit of {self.limit} bytes "
            "(lmforge serve --max-request-bytes)",
            code="request_too_large",
        )


# ---- turning requests into sequences --------------------------------------------------------


@dataclass
class _Plan:
    """What one generation request asks of the engine."""

    sequences: list[SequenceRequest]
    prompt_lengths: list[int]  # per distinct prompt


def _check_unsupported(body: _GenerationRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise ApiError(
                400,
                f"'{name}' other than 0 is not supported by this server",
                param=name,
                code="unsupported_parameter",
            )
    if body.logit_bias:
        raise ApiError(
            400,
            "'logit_bias' is not supported by this server",
            param="logit_bias",
            code="unsupported_parameter",
        )
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise ApiError(
                400, "'echo' is not supported", param="echo", code="unsupported_parameter"
            )
        if body.suffix:
            raise ApiError(
                400, "'suffix' is not supported", param="suffix", code="unsupported_parameter"
            )
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise ApiError(
                400,
                "'best_of' other than n is not supported by this server",
                param="best_of",
                code="unsupported_parameter",
            )


def _encode_prompts(body: _GenerationRequest, generator: Generator) -> tuple[list, str]:
    """The prompts' token ids and the parameter that holds them."""
    tokenizer = generator.tokenizer
    if isinstance(body, ChatCompletionRequest):
        messages = []
        for message in body.messages:
            content = message.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": content or ""})
        if tokenizer.chat_template is None:
            raise ApiError(
                400,
                "this model has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        try:
            return [tokenizer.encode_chat(messages, add_generation_prompt=True)], "messages"
        except UserError as err:
            raise ApiError(400, str(err), param="messages", code="invalid_value") from None
    prompt = body.prompt
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    ids = []
    for prompt in prompts:
        try:
            ids.append(generator.encode_prompt(prompt))
        except UserError as err:
            raise ApiError(400, str(err), param="prompt", code="invalid_value") from None
    for prompt_ids in ids:
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
    return ids, "prompt"


def _plan(body: _GenerationRequest, generator: Generator, settings: ServeSettings) -> _Plan:
    """Check a validated request against the model and the limits; build its sequences."""
    _check_unsupported(body)
    n = body.n or 1
    num_prompts = 1
    if isinstance(body, CompletionRequest) and not isinstance(body.prompt, str):
        # A list (never empty) of texts or of token-id lists, or one prompt's token ids.
        num_prompts = 1 if isinstance(body.prompt[0], int) else len(body.prompt)
    limit = min(settings.max_n, generator.max_batch + settings.max_queue)
    if n * num_prompts > limit:
        what = f"n={n}" if num_prompts == 1 else f"n={n} for {num_prompts} prompts"
        raise ApiError(
            400,
            f"{what} asks for {n * num_prompts} choices; at most {limit}",
            param="n",
            code="invalid_value",
        )
    prompts, prompt_param = _encode_prompts(body, generator)
    context = generator.max_seq_len
    max_tokens = body.max_tokens
    max_tokens_param = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, max_tokens_param = body.max_completion_tokens, "max_completion_tokens"
    longest = max(len(ids) for ids in prompts)
    if longest >= context:
        raise ApiError(
            400,
            f"this model's context is {context} tokens; the prompt has {longest} tokens, which "
            "leaves no room for new ones",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and longest + max_tokens > context:
        raise ApiError(
            400,
            f"this model's context is {context} tokens; the prompt ({longest} tokens) plus "
            f"{max_tokens_param}={max_tokens} exceeds it",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    if isinstance(body, ChatCompletionRequest):
        num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise ApiError(
                400,
                "'top_logprobs' needs 'logprobs': true",
                param="top_logprobs",
                code="invalid_value",
            )
    else:
        num_logprobs = body.logprobs
    top_k = body.top_k if body.top_k and body.top_k > 0 else None
    sequences = []
    for ids in prompts:
        if max_tokens is not None:
            limit_tokens = max_tokens
        elif isinstance(body, CompletionRequest):
            limit_tokens = min(16, context - len(ids))  # OpenAI's default for completions
        else:
            limit_tokens = context - len(ids)
        params = SamplingParams(
            max_new_tokens=limit_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=None if top_k is None else min(top_k, generator.args.vocab_size),
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
            stop_token_ids=() if body.ignore_eos else None,
        )
        for choice in range(n):
            seed = None if body.seed is None else body.seed + choice
            sequences.append(SequenceRequest(ids, params, seed, num_logprobs))
    return _Plan(sequences, [len(ids) for ids in prompts])


# ---- responses ------------------------------------------------------------------------------


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenOutput] | None = None


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _completion_logprobs(tokenizer, outputs: list[TokenOutput]) -> dict:
    tokens, offsets, offset = [], [], 0
    for output in outputs:
        token = _token_text(tokenizer, output.token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [o.logprob for o in outputs],
        "top_logprobs": [_top_by_text(tokenizer, o.top_logprobs) for o in outputs],
        "text_offset": offsets,
    }


def _top_by_text(tokenizer, top: list[tuple[int, float]] | None) -> dict[str, float] | None:
    """{token text: logprob}, best first; of tokens with the same text the likelier counts."""
    if top is None:
        return None
    by_text: dict[str, float] = {}
    for token_id, logprob in top:
        by_text.setdefault(_token_text(tokenizer, token_id), logprob)
    return by_text


def _chat_logprobs(tokenizer, outputs: list[TokenOutput]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        token = _token_text(tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(o.token_id, o.logprob),
                "top_logprobs": [entry(i, lp) for i, lp in o.top_logprobs or []],
            }
            for o in outputs
        ]
    }


class _Session:
    """One generation request's run through the engine (admitted on creation, or a 429)."""

    def __init__(self, state, request: Request, body: _GenerationRequest, plan: _Plan) -> None:
        self.state = state
        self.request = request
        self.body = body
        self.plan = plan
        self.chat = isinstance(body, ChatCompletionRequest)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.want_logprobs = plan.sequences[0].num_logprobs is not None
        timeout = state.settings.request_timeout
        self.deadline = asyncio.get_running_loop().time() + timeout if timeout else None
        try:
            self.submission = state.engine.submit(plan.sequences)
        except QueueFull as err:
            raise ApiError(
                429,
                f"the server is busy: {err}; retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(state.settings.retry_after)},
            ) from None
        state.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in plan.sequences))
        self._first_token_seen = False

    @property
    def usage(self) -> dict:
        prompt_tokens = sum(self.plan.prompt_lengths)
        completion_tokens = sum(len(s.token_ids) for s in self.submission.sequences)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def events(self) -> AsyncIterator[TokenOutput]:
        """The engine's outputs until every choice has finished; TimeoutError past the
        deadline, RuntimeError if the engine failed."""
        async for output in self.submission.events(deadline=self.deadline):
            if output.finish_reason == "error":
                raise RuntimeError("generation failed (see the server log)")
            if output.finish_reason == "shutdown":
                raise _ShuttingDown
            if not self._first_token_seen:
                self._first_token_seen = True
                self.state.metrics.first_token.observe(time.perf_counter() - self.arrival)
            yield output

    @staticmethod
    def shutdown_error() -> ApiError:
        return ApiError(
            503,
            "the server is shutting down and this request did not finish within its grace "
            "period; retry on another server",
            type="server_error",
            code="server_shutting_down",
        )

    def timeout_error(self) -> ApiError:
        timeout = self.state.settings.request_timeout
        return ApiError(
            408,
            f"the request took longer than the server's timeout of {timeout:g} s",
            type="timeout_error",
            code="request_timeout",
        )

    def _logprobs(self, outputs: list[TokenOutput]) -> dict:
        tokenizer = self.state.generator.tokenizer
        if self.chat:
            return _chat_logprobs(tokenizer, outputs)
        return _completion_logprobs(tokenizer, outputs)

    def _header(self, object_name: str) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.state.settings.model_name,
        }

    # -- a whole response --

    async def _collect(self) -> list[_Choice]:
        choices = [
            _Choice(logprobs=[] if self.want_logprobs else None) for _ in self.plan.sequences
        ]
        async for output in self.events():
            choice = choices[output.choice]
            choice.text += output.text
            if choice.logprobs is not None and not output.is_stop_token:
                choice.logprobs.append(output)
            if output.finish_reason is not None:
                choice.finish_reason = output.finish_reason
        return choices

    async def respond(self) -> JSONResponse:
        """Wait for every choice (or the client leaving, or the timeout)."""
        collect = asyncio.create_task(self._collect())
        gone = asyncio.create_task(_wait_for_disconnect(self.request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # the client left: nobody reads what we answer
                self.submission.cancel("cancelled")
                return JSONResponse({}, status_code=499)
            choices = collect.result()
        except TimeoutError:
            self.submission.cancel("timeout")
            raise self.timeout_error() from None
        except _ShuttingDown:
            raise self.shutdown_error() from None
        finally:
            gone.cancel()
            collect.cancel()
            self.submission.cancel("cancelled")  # a no-op when everything finished
        body = self._header("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._choice_body(i, c) for i, c in enumerate(choices)]
        body["usage"] = self.usage
        if self.chat:
            body["system_fingerprint"] = None
        return JSONResponse(body)

    def _choice_body(self, index: int, choice: _Choice) -> dict:
        logprobs = None if choice.logprobs is None else self._logprobs(choice.logprobs)
        if self.chat:
            message = {"role": "assistant", "content": choice.text}
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
            }
        return {
            "index": index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }

    # -- a stream of server-sent events --

    async def stream(self) -> AsyncIterator[str]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        header = self._header("chat.completion.chunk" if self.chat else "text_completion")
        extra = {"usage": None} if include_usage else {}
        try:
            if self.chat:
                for index in range(len(self.plan.sequences)):
                    delta = {"role": "assistant", "content": ""}
                    choice = {"index": index, "delta": delta, "logprobs": None}
                    yield _sse({**header, "choices": [{**choice, "finish_reason": None}], **extra})
            async for output in self.events():
                logprobs = None
                if self.want_logprobs and output.token_id >= 0 and not output.is_stop_token:
                    logprobs = self._logprobs([output])
                if not output.text and output.finish_reason is None and logprobs is None:
                    continue
                choice = {"index": output.choice}
                if self.chat:
                    choice["delta"] = {"content": output.text} if output.text else {}
                else:
                    choice["text"] = output.text
                choice["logprobs"] = logprobs
                choice["finish_reason"] = output.finish_reason
                yield _sse({**header, "choices": [choice], **extra})
            if include_usage:
                yield _sse({**header, "choices": [], "usage": self.usage})
        except TimeoutError:
            self.submission.cancel("timeout")
            err = self.timeout_error()
            yield _sse(error_body(err.message, type=err.type, param=None, code=err.code))
        except _ShuttingDown:
            err = self.shutdown_error()
            yield _sse(error_body(err.message, type=err.type, param=None, code=err.code))
        except RuntimeError as err:
            yield _sse(error_body(str(err), type="server_error", param=None, code=None))
        yield "data: [DONE]\n\n"


class _ShuttingDown(Exception):
    """The drain's grace period ran out before the request finished."""


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _EventStream(StreamingResponse):
    """Server-sent events of one session; whatever ends it (the client leaving, the drain's
    grace period running out) frees the session's rows."""

    def __init__(self, session: _Session) -> None:
        super().__init__(
            session.stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.session = session

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.session.submission.cancel("cancelled")  # a no-op when everything finished


# ---- the app --------------------------------------------------------------------------------


def create_app(generator: Generator, settings: ServeSettings) -> FastAPI:
    """The API over `generator` (its max_batch sequences run at once). The engine starts and
    stops with the app's lifespan."""
    if generator.tokenizer is None:
        raise UserError("serving needs a model with a tokenizer (tokenizer.json)")
    metrics = Metrics()
    engine = Engine(
        generator,
        max_queue=settings.max_queue,
        on_finish=metrics.on_finish,
        on_step=metrics.batch_size.observe,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(
        title="lmforge",
        summary="OpenAI-compatible completions and chat completions",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.generator = generator
    app.state.settings = settings
    app.state.engine = engine
    app.state.metrics = metrics
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "").lower()
        json_body = "json" in content_type.split(";")[0]
        return _error_response(_validation_error(list(err.errors()), json_body=json_body))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            message, code = f"no route {request.method} {request.url.path}", "not_found"
        elif err.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", None
        else:
            message, code = str(err.detail), None
        return _error_response(
            ApiError(err.status_code, message, code=code, headers=dict(err.headers or {}))
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.error("internal error on %s", request.url.path, exc_info=err)
        return _error_response(ApiError(500, "internal server error", type="server_error"))

    def model_card() -> dict:
        return {
            "id": settings.model_name,
            "object": "model",
            "created": created,
            "owned_by": "lmforge",
            "max_model_len": generator.max_seq_len,
        }

    def check_model(name: str) -> None:
        if name != settings.model_name:
            raise ApiError(
                404,
                f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        check_model(model)
        return model_card()

    async def generate(request: Request, body: _GenerationRequest) -> Response:
        check_model(body.model)
        session = _Session(app.state, request, body, _plan(body, generator, settings))
        if body.stream:
            return _EventStream(session)
        return await session.respond()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, body)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.running:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.queue_depth.set(engine.num_waiting)
        metrics.running.set(engine.num_running)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(_BodyLimitMiddleware, limit=settings.max_request_bytes)
    if settings.api_key:  # outside the body limit: no key, no reading of the body
        app.add_middleware(_AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)  # outermost: 401s count too
    return app


# ---- running it -----------------------------------------------------------------------------


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
