"""The OpenAI-compatible HTTP API: `create_app(model, settings, channel)` builds the FastAPI app
around the front end of the engine (engine.py's `Engine`), which talks to the engine loop over
`channel` (a thread of this process, or the main process when HTTP runs in a process of its
own: frontend.py) and starts and stops with the app's lifespan.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both also as
server-sent events with `"stream": true`, ending with `data: [DONE]`), vLLM's `POST /tokenize`
(a prompt or a chat's messages -> {count, max_model_len, tokens}) and `POST /detokenize`
(tokens -> {prompt}), vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (LoRA
adapters a request names as its "model"), `GET /health` (never behind the API key) and `GET
/metrics` (Prometheus text). The wire format and the error envelope are protocol.py's; a request's run through the
engine is session.py's; running the app under uvicorn is server.py's. An unknown model is a
404; a missing or wrong `Authorization: Bearer` key a 401 (compared in constant time).
"""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmforge.errors import ConfigError, UserError
from lmforge.serve.engine import Engine, EngineStopped
from lmforge.serve.middleware import AuthMiddleware, BodyLimitMiddleware, Metrics, MetricsMiddleware
from lmforge.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    LoadAdapterRequest,
    ServeSettings,
    TokenizeRequest,
    UnloadAdapterRequest,
    error_response,
    validation_error,
)
from lmforge.serve.session import (
    EventStream,
    ServedModel,
    Session,
    check_formats,
    detokenize,
    plan_request,
    tokenize,
)

logger = logging.getLogger("lmforge.serve")


def create_app(model: ServedModel, settings: ServeSettings, channel) -> FastAPI:
    """The API over `model` (its max_batch sequences run at once), generating through the
    engine loop at the other end of `channel` (engine.py's `ThreadChannel`, frontend.py's
    `PipeChannel`), which starts and stops with the app's lifespan."""
    if model.tokenizer is None:
        raise UserError("serving needs a model with a tokenizer (tokenizer.json)")
    metrics = Metrics()
    engine = Engine(
        channel,
        max_concurrency=model.max_batch,
        max_queue=settings.max_queue,
        on_finish=metrics.on_finish,
        on_step=metrics.on_step,
        on_first_token=metrics.prefix_cache_hits.inc,
        stream_interval=settings.stream_interval,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        unwatch_gc = metrics.watch_gc()
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()
            unwatch_gc()

    app = FastAPI(
        title="lmforge",
        summary="OpenAI-compatible completions and chat completions",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.model = model
    app.state.settings = settings
    app.state.engine = engine
    app.state.metrics = metrics
    adapters = dict(settings.adapters)  # name -> path: the LoRA adapters the engine holds
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "").lower()
        json_body = "json" in content_type.split(";")[0]
        return error_response(validation_error(list(err.errors()), json_body=json_body))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            message, code = f"no route {request.method} {request.url.path}", "not_found"
        elif err.status_code == 405:
            message, code = f"{request.method} is not allowed on {request.url.path}", None
        else:
            message, code = str(err.detail), None
        return error_response(
            ApiError(err.status_code, message, code=code, headers=dict(err.headers or {}))
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.error("internal error on %s", request.url.path, exc_info=err)
        return error_response(ApiError(500, "internal server error", type="server_error"))

    def model_card(name: str | None = None) -> dict:
        """The base model's card, or adapter `name`'s (vLLM's fields: parent and root)."""
        card = {
            "id": name or settings.model_name,
            "object": "model",
            "created": created,
            "owned_by": "lmforge",
            "max_model_len": model.max_seq_len,
        }
        if name is not None:
            card |= {"parent": settings.model_name, "root": adapters[name]}
        return card

    def check_model(name: str) -> str | None:
        """None for the base model, the adapter's name for an adapter; else a 404."""
        if name == settings.model_name:
            return None
        if name in adapters:
            return name
        served = ", ".join(repr(n) for n in [settings.model_name, *adapters])
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(), *map(model_card, adapters)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict:
        return model_card(check_model(model))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterRequest) -> Response:
        name = body.lora_name
        if name == settings.model_name or name in adapters:
            raise ApiError(400, f"a model named {name!r} is already served", param="lora_name")
        await change_adapter("lora_path", "load_adapter", name, body.lora_path)
        adapters[name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterRequest) -> Response:
        name = body.lora_name
        if name not in adapters:
            raise ApiError(
                404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                code="model_not_found",
            )  # fmt: skip
        await change_adapter("lora_name", "unload_adapter", name)
        del adapters[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def change_adapter(param: str, *op) -> None:
        """The engine loop's load or unload; what it refuses (bad files, a full table, an
        adapter in use) is a 400 naming `param`, and the server goes on."""
        try:
            await engine.change_adapter(*op)
        except ConfigError as err:
            raise ApiError(400, str(err), param=param) from None
        except EngineStopped:
            raise ApiError(
                503, "the server's engine is not running (see the server log)",
                type="server_error", code="engine_stopped",
            ) from None  # fmt: skip

    async def generate(request: Request, body: GenerationRequest) -> Response:
        adapter = check_model(body.model)
        plan = plan_request(body, model, settings, adapter)
        await check_formats(plan)
        session = Session(app.state, request, body, plan)
        if body.stream:
            return EventStream(session)
        return await session.respond()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, body)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict:
        if body.model is not None:
            check_model(body.model)
        tokens = tokenize(body, model)
        return {"count": len(tokens), "max_model_len": model.max_seq_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            check_model(body.model)
        return {"prompt": detokenize(body, model)}

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

    app.add_middleware(
        BodyLimitMiddleware, limit=settings.max_request_bytes, timeout=settings.body_timeout
    )
    if settings.api_key:  # outside the body limit: no key, no reading of the body
        app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: 401s count too
    return app
