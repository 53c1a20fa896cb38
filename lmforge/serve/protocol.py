"""The wire format of the OpenAI-compatible API: the server's limits, the request bodies
(pydantic models) and the error envelope.

The contract for bad input: every client mistake is a 4xx with OpenAI's envelope
`{"error": {"message", "type", "param", "code"}}` naming the parameter at fault; never a 5xx.
Request bodies are validated strictly (wrong types are not coerced, unknown keys are refused,
as OpenAI does); `validation_error` turns FastAPI's validation errors into one 400 that names the
deepest parameter at fault.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHAT_TOP_LOGPROBS = 20  # and for /v1/chat/completions
# The largest `response_format` JSON schema (its JSON text, UTF-8): the engine loop compiles a
# new schema while every stream waits (0.2 s for 30 properties over a 50k vocabulary on one
# CPU core), and xgrammar's time and memory grow with the schema.
MAX_SCHEMA_BYTES = 64 * 1024
# The most tools a request may list (OpenAI's limit); their JSON text counts against
# MAX_SCHEMA_BYTES too: "required" compiles every tool's parameters into one grammar.
MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs' keys (vLLM's), e.g. Qwen3's enable_thinking


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
        body_timeout: seconds a request's body may take to arrive, else 408 (a client that
            declares a length and sends less would hold its connection for ever).
        stream_interval: engine steps between a decoding sequence's deliveries to its request
            (None: the engine's load-dependent default; see `lmforge.serve.engine.Engine`).
        adapters: the LoRA adapters the engine loaded at start, (name, path) each: requests
            name one as their "model" (more load and unload at run time).
        reasoning_parser: "qwen3" or "deepseek_r1": a chat answer's `<think>` text goes to its
            `reasoning` (lmforge/serve/reasoning.py); None: all of it is content.
    """

    model_name: str
    api_key: str | None = None
    max_queue: int = 64
    max_n: int = 8
    request_timeout: float | None = 600.0
    retry_after: int = 1
    max_request_bytes: int = 8 << 20
    body_timeout: float = 30.0
    stream_interval: int | None = None
    reasoning_parser: str | None = None
    # LoRA adapters loaded at start (`lmforge serve --lora NAME=PATH`): (name, path) each
    adapters: tuple[tuple[str, str], ...] = ()


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


def error_response(err: ApiError) -> JSONResponse:
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


def validation_error(errors: list[dict], *, json_body: bool = True) -> ApiError:
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


class JsonSchema(_Strict):
    """OpenAI's `response_format.json_schema`; `strict` is taken as true whatever it says (the
    output always follows the schema, as vLLM's)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """Plain text, any JSON object, or JSON that a schema allows."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_goes_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema', and only there")
        return self


class GenerationRequest(_Strict):
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
    # vLLM's extensions: min-p sampling (0: off), stop token ids besides EOS (with ignore_eos
    # the only ones), no stop (token or string) before min_tokens new tokens
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    # vLLM's extension: logprobs name their tokens "token_id:N" (not the token's text)
    return_tokens_as_token_ids: bool | None = None
    # OpenAI's for chat completions; vLLM takes it for completions too
    response_format: ResponseFormat | None = None


class CompletionRequest(GenerationRequest):
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


# OpenAI's rule for function names; it also keeps them plain inside a call's JSON text.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # a JSON object's text, as OpenAI's responses carry it


class ToolCall(_Strict):
    """A call an assistant's message made earlier in the chat."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "ipython"]
    content: Text | list[TextPart] | None  # required; null only for an assistant's turn
    name: Text | None = None
    tool_call_id: Text | None = None  # a tool's message: the call it answers
    tool_calls: list[ToolCall] | None = None  # an assistant's message only

    @field_validator("content")
    @classmethod
    def _content_given(cls, content, info):
        if content is None and info.data.get("role") != "assistant":
            raise ValueError("content is null; only an assistant's message may have none")
        return content

    @model_validator(mode="after")
    def _tool_fields_go_with_their_role(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant's message may have 'tool_calls'")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool's message needs the 'tool_call_id' of the call it answers")
        return self


# The names a template reads that the request's own fields set: not overridable
RESERVED_TEMPLATE_VARIABLES = frozenset(
    ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
     "pad_token", "unk_token")
)  # fmt: skip


def _template_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(kwargs))
    if reserved:
        raise ValueError(f"{reserved[0]!r} is set by the request itself, not a template variable")
    return kwargs


TemplateKwargs = Annotated[
    dict[Text, Any], Field(max_length=MAX_TEMPLATE_KWARGS), AfterValidator(_template_names)
]


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Text | None = None
    # A JSON schema of the arguments object (None: any object); see session.py's checks
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # taken as true: forced calls always follow `parameters`


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables for the chat template (Qwen3's {"enable_thinking": false})
    chat_template_kwargs: TemplateKwargs | None = None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text (`prompt`, BOS first unless add_special_tokens is false) or a
    chat (`messages`, rendered as /v1/chat/completions renders them; BOS only from the
    template unless add_special_tokens is true), one of the two."""

    model: Text | None = None  # optional, as in vLLM; a wrong one is a 404
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = None  # messages only; default true
    chat_template_kwargs: TemplateKwargs | None = None  # messages only, as in chat


class LoadAdapterRequest(_Strict):
    """vLLM's /v1/load_lora_adapter: a PEFT LoRA directory on the server's disk, served as
    the model `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadAdapterRequest(_Strict):
    """vLLM's /v1/unload_lora_adapter."""

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids back to text."""

    model: Text | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
