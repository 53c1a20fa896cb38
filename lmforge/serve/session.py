"""One generation request's way through the engine: checked against the model and the limits
and turned into engine sequences (`plan_request`), then answered as one JSON body or as a stream of
server-sent events (`Session`, `EventStream`) with OpenAI's completion and chat shapes. vLLM's
/tokenize and /detokenize (`tokenize`, `detokenize`) encode as these requests do, without the
engine.

A request past its timeout is a 408, a full queue a 429 with `Retry-After`, a request still
running when the drain's grace period ends a 503 (a last error event for streams). A client
that disconnects frees its rows at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from lmforge.errors import ConfigError, UserError
from lmforge.generate import Generator, SamplingParams
from lmforge.generate.grammar import JsonFormat, check_json_format
from lmforge.generate.sequence import Prompt, encode_prompt
from lmforge.serve.engine import EngineStopped, QueueFull, SequenceRequest, TokenOutput
from lmforge.serve.protocol import (
    MAX_SCHEMA_BYTES,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    ServeSettings,
    TokenizeRequest,
    Tool,
    error_body,
)
from lmforge.serve.reasoning import ReasoningSplitter, starts_thinking
from lmforge.serve.tools import (
    GENERIC,
    ToolCallParser,
    ToolUse,
    deltas_of,
    message_of,
    template_messages,
    tool_call_style,
    tool_use,
)

# ---- turning requests into sequences --------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP side knows of the model: its tokenizer and limits (picklable: it travels
    to the server's HTTP process)."""

    tokenizer: object  # lmforge.data.tokenizer.Tokenizer
    max_seq_len: int  # the cache's context
    max_batch: int  # sequences decoded together
    vocab_size: int

    @classmethod
    def of(cls, generator: Generator) -> ServedModel:
        return cls(
            generator.tokenizer,
            generator.max_seq_len,
            generator.max_batch,
            generator.args.vocab_size,
        )

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, vocab_size=self.vocab_size)


@dataclass
class _Plan:
    """What one generation request asks of the engine."""

    sequences: list[SequenceRequest]
    prompt_lengths: list[int]  # per distinct prompt
    tools: ToolUse  # (a chat's; ToolUse() for none)
    format_param: str = "response_format"  # what asked for the sequences' json_format
    thinking: bool | None = None  # the answer starts in its reasoning; None: no reasoning split


def _check_unsupported(body: GenerationRequest) -> None:
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


def encode_chat(
    model: ServedModel,
    messages: list[ChatMessage],
    *,
    tools: list[Tool] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of a request's chat (with `tools` listed, lmforge.serve.protocol's `Tool`s),
    rendered with the chat template as tools.py's `template_messages` lays it out, with the
    request's `chat_template_kwargs` (a 400 naming 'messages' where it cannot be)."""
    tokenizer = model.tokenizer
    if tokenizer.chat_template is None:
        raise ApiError(
            400,
            "this model has no chat template; use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    style = tool_call_style(tokenizer) if tools or _has_tool_turns(messages) else GENERIC
    rendered, template_vars = template_messages(messages, tools, style)
    try:
        return tokenizer.encode_chat(
            rendered,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
            **template_vars,
        )
    except UserError as err:
        raise ApiError(400, str(err), param="messages", code="invalid_value") from None


def _has_tool_turns(messages: list[ChatMessage]) -> bool:
    return any(message.tool_calls or message.role == "tool" for message in messages)


def _encode_prompts(
    body: GenerationRequest, model: ServedModel, tools: ToolUse
) -> tuple[list, str]:
    """The prompts' token ids and the parameter that holds them."""
    if isinstance(body, ChatCompletionRequest):
        ids = encode_chat(
            model, body.messages, tools=tools.listed, template_kwargs=body.chat_template_kwargs
        )
        return [ids], "messages"
    prompt = body.prompt
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    ids = []
    for prompt in prompts:
        try:
            ids.append(model.encode_prompt(prompt))
        except UserError as err:
            raise ApiError(400, str(err), param="prompt", code="invalid_value") from None
    for prompt_ids in ids:
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
    return ids, "prompt"


def tokenize(body: TokenizeRequest, model: ServedModel) -> list[int]:
    """vLLM's /tokenize: the ids of a prompt (as /v1/completions encodes it) or of a chat (as
    /v1/chat/completions does)."""
    tokenizer = model.tokenizer
    if body.prompt is not None and body.messages is not None:
        raise ApiError(
            400, "give 'prompt' or 'messages', not both", param="messages", code="invalid_value"
        )
    if body.messages is not None:
        add_generation_prompt = body.add_generation_prompt is not False
        ids = encode_chat(
            model, body.messages, tools=body.tools, add_generation_prompt=add_generation_prompt,
            template_kwargs=body.chat_template_kwargs,
        )  # fmt: skip
        if body.add_special_tokens and tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id, *ids]
        return ids
    if body.prompt is None:
        raise ApiError(
            400,
            "missing required parameter 'prompt' (or 'messages')",
            param="prompt",
            code="missing",
        )
    for name in ("add_generation_prompt", "chat_template_kwargs"):
        if getattr(body, name) is not None:
            raise ApiError(
                400,
                f"'{name}' goes with 'messages', not with 'prompt'",
                param=name,
                code="invalid_value",
            )
    bos = body.add_special_tokens is not False and tokenizer.bos_id is not None
    return tokenizer.encode(body.prompt, bos=bos)


def detokenize(body: DetokenizeRequest, model: ServedModel) -> str:
    """vLLM's /detokenize: the text of token ids (special tokens included)."""
    vocab_size = min(model.vocab_size, getattr(model.tokenizer, "vocab_size", model.vocab_size))
    for index, token_id in enumerate(body.tokens):
        if token_id >= vocab_size:
            raise ApiError(
                400,
                f"token id {token_id} (tokens[{index}]) is outside the vocabulary "
                f"(0..{vocab_size - 1})",
                param="tokens",
                code="invalid_value",
            )
    return model.tokenizer.decode(body.tokens)


def _stop_token_ids(body: GenerationRequest, model: ServedModel) -> tuple[int, ...] | None:
    """The request's stop ids as vLLM takes them: `stop_token_ids` besides the tokenizer's
    (EOS, end of turn), or alone with `ignore_eos`; None: the engine's default."""
    extra = body.stop_token_ids or []
    bad = [i for i in extra if i >= model.vocab_size]
    if bad:
        raise ApiError(
            400,
            f"stop token id {bad[0]} is outside the vocabulary (0..{model.vocab_size - 1})",
            param="stop_token_ids",
            code="invalid_value",
        )
    if body.ignore_eos:
        return tuple(dict.fromkeys(extra))
    if not extra:
        return None
    return tuple(sorted({*model.tokenizer.stop_ids, *extra}))


def _json_format(body: GenerationRequest, tools: ToolUse) -> tuple[JsonFormat | None, str]:
    """The JSON the request asks for (None: text) and the parameter that asks: a forced tool
    call's grammar ("tools"), or the `response_format`'s, its schema within MAX_SCHEMA_BYTES."""
    response_format = body.response_format
    wants_json = response_format is not None and response_format.type != "text"
    if tools.forced is not None:
        if wants_json:
            raise ApiError(
                400,
                "'response_format' cannot go with tool_choice 'required' or a named function: "
                "the answer is then tool calls",
                param="response_format",
                code="invalid_value",
            )
        json_format, param = tools.forced, "tools"
    elif not wants_json:
        return None, "response_format"
    else:
        json_format, param = _response_json(response_format), "response_format"
    if body.min_tokens:
        what = "a forced tool call" if tools.forced else "a JSON response_format"
        raise ApiError(
            400,
            f"'min_tokens' cannot go with {what}: where the JSON is complete only a stop token "
            "is allowed",
            param="min_tokens",
            code="invalid_value",
        )
    return json_format, param


def _response_json(response_format) -> JsonFormat:
    if response_format.json_schema is None:
        return JsonFormat()  # json_object
    json_format = JsonFormat.of(response_format.json_schema.schema_)
    size = len(json_format.schema.encode())
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(
            400,
            f"the response_format's JSON schema has {size} bytes; at most {MAX_SCHEMA_BYTES}",
            param="response_format",
            code="invalid_value",
        )
    return json_format


async def check_formats(plan: _Plan) -> None:
    """A 400 naming the parameter where the engine could not follow a schema the request
    gives (a tool's parameters, the response_format; xgrammar's reason) or xgrammar is missing
    (what to install); off the event loop: the first check imports xgrammar (~1 s), and a
    large schema takes a while to read."""
    json_format = plan.sequences[0].params.json_format
    if json_format is None and not plan.tools.schemas:
        return
    await asyncio.to_thread(_check_formats, plan.tools.schemas, json_format, plan.format_param)


def _check_formats(
    tool_schemas: tuple[JsonFormat, ...], json_format: JsonFormat | None, param: str
) -> None:
    checks = [(f"tools[{i}].function.parameters", schema) for i, schema in enumerate(tool_schemas)]
    if json_format is not None:
        checks.append((param, json_format))
    for name, checked in checks:
        try:
            check_json_format(checked)
        except ConfigError as err:
            message = f"{name}: {err}" if name.startswith("tools[") else str(err)
            raise ApiError(400, message, param=name, code="invalid_value") from None


def plan_request(
    body: GenerationRequest,
    model: ServedModel,
    settings: ServeSettings,
    adapter: str | None = None,
) -> _Plan:
    """Check a validated request against the model and the limits; build its sequences (with
    LoRA adapter `adapter`: the request's "model" named one)."""
    _check_unsupported(body)
    n = body.n or 1
    num_prompts = 1
    if isinstance(body, CompletionRequest) and not isinstance(body.prompt, str):
        # A list (never empty) of texts or of token-id lists, or one prompt's token ids.
        num_prompts = 1 if isinstance(body.prompt[0], int) else len(body.prompt)
    limit = min(settings.max_n, model.max_batch + settings.max_queue)
    if n * num_prompts > limit:
        what = f"n={n}" if num_prompts == 1 else f"n={n} for {num_prompts} prompts"
        raise ApiError(
            400,
            f"{what} asks for {n * num_prompts} choices; at most {limit}",
            param="n",
            code="invalid_value",
        )
    tools = ToolUse()
    if isinstance(body, ChatCompletionRequest):
        tools = tool_use(body, model.tokenizer)
    prompts, prompt_param = _encode_prompts(body, model, tools)
    context = model.max_seq_len
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
    stop_token_ids = _stop_token_ids(body, model)
    json_format, format_param = _json_format(body, tools)
    min_tokens = body.min_tokens or 0
    sequences = []
    for ids in prompts:
        if max_tokens is not None:
            limit_tokens = max_tokens
        elif isinstance(body, CompletionRequest):
            limit_tokens = min(16, context - len(ids))  # OpenAI's default for completions
        else:
            limit_tokens = context - len(ids)
        if min_tokens > limit_tokens:
            limit = (
                f"{max_tokens_param}={max_tokens}"
                if max_tokens is not None
                else f"the {limit_tokens} tokens this request may generate"
            )
            raise ApiError(
                400,
                f"min_tokens={min_tokens} must be at most {limit}",
                param="min_tokens",
                code="invalid_value",
            )
        params = SamplingParams(
            max_new_tokens=limit_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=None if top_k is None else min(top_k, model.vocab_size),
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            json_format=json_format,
        )
        for choice in range(n):
            seed = None if body.seed is None else body.seed + choice
            sequences.append(SequenceRequest(ids, params, seed, num_logprobs, adapter))
    thinking = None
    if isinstance(body, ChatCompletionRequest) and settings.reasoning_parser and not json_format:
        # (a constrained answer is JSON from its first token: no reasoning to split)
        tail = model.tokenizer.decode(prompts[0][-8:])
        thinking = starts_thinking(settings.reasoning_parser, tail)
    return _Plan(sequences, [len(ids) for ids in prompts], tools, format_param, thinking)


# ---- responses ------------------------------------------------------------------------------


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenOutput] | None = None


def _token_id_text(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form: any token identified, even one whose text is
    an incomplete UTF-8 character."""
    return f"token_id:{token_id}"


def _completion_logprobs(token_text: Callable[[int], str], outputs: list[TokenOutput]) -> dict:
    tokens, offsets, offset = [], [], 0
    for output in outputs:
        token = token_text(output.token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [o.logprob for o in outputs],
        "top_logprobs": [_top_by_text(token_text, o.top_logprobs) for o in outputs],
        "text_offset": offsets,
    }


def _top_by_text(
    token_text: Callable[[int], str], top: list[tuple[int, float]] | None
) -> dict[str, float] | None:
    """{token text: logprob}, best first; of tokens with the same text the likelier counts."""
    if top is None:
        return None
    by_text: dict[str, float] = {}
    for token_id, logprob in top:
        by_text.setdefault(token_text(token_id), logprob)
    return by_text


def _chat_logprobs(token_text: Callable[[int], str], outputs: list[TokenOutput]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        token = token_text(token_id)
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


class Session:
    """One generation request's run through the engine (admitted on creation, or a 429)."""

    def __init__(self, state, request: Request, body: GenerationRequest, plan: _Plan) -> None:
        self.state = state
        self.request = request
        self.body = body
        self.plan = plan
        self.chat = isinstance(body, ChatCompletionRequest)
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.want_logprobs = plan.sequences[0].num_logprobs is not None
        # a stream's calls are read as its text comes, one parser a choice
        self.parsers = None
        if plan.tools.style is not None:
            self.parsers = [self._tool_call_parser() for _ in plan.sequences]
        self.splitters = None  # and its reasoning split from its content, one a choice
        if plan.thinking is not None:
            self.splitters = [ReasoningSplitter(thinking=plan.thinking) for _ in plan.sequences]
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
        except EngineStopped:
            raise ApiError(
                503,
                "the server's engine is not running (see the server log); retry on another server",
                type="server_error",
                code="engine_stopped",
            ) from None
        state.metrics.prompt_tokens.inc(sum(len(s.prompt_ids) for s in plan.sequences))
        self._first_token_seen = False

    @property
    def usage(self) -> dict:
        prompt_tokens = sum(self.plan.prompt_lengths)
        completion_tokens = self.submission.num_tokens
        cached = min(self.submission.cached_tokens, prompt_tokens)  # from the prefix cache
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def events(self) -> AsyncIterator[list[TokenOutput]]:
        """The engine's outputs, in batches, until every choice has finished; TimeoutError
        past the deadline, RuntimeError if the engine failed."""
        async for batch in self.submission.events(deadline=self.deadline):
            reasons = {output.finish_reason for output in batch}
            if "error" in reasons:
                raise RuntimeError("generation failed (see the server log)")
            if "shutdown" in reasons:
                raise _ShuttingDown
            if not self._first_token_seen:
                self._first_token_seen = True
                self.state.metrics.first_token.observe(time.perf_counter() - self.arrival)
            yield batch

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

    def _decode_one(self, token_id: int) -> str:
        return self.state.model.tokenizer.decode([token_id])

    def _logprobs(self, outputs: list[TokenOutput]) -> dict:
        token_text = _token_id_text if self.body.return_tokens_as_token_ids else self._decode_one
        if self.chat:
            return _chat_logprobs(token_text, outputs)
        return _completion_logprobs(token_text, outputs)

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
        async for batch in self.events():
            for output in batch:
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

    def _tool_call_parser(self) -> ToolCallParser:
        return ToolCallParser(self.plan.tools.style, max_calls=self.plan.tools.max_calls)

    def _choice_body(self, index: int, choice: _Choice) -> dict:
        logprobs = None if choice.logprobs is None else self._logprobs(choice.logprobs)
        if self.chat:
            message: dict = {"role": "assistant", "content": choice.text}
            if self.plan.thinking is not None:
                splitter = ReasoningSplitter(thinking=self.plan.thinking)
                reasoning, message["content"] = splitter.split(choice.text)
                message["reasoning"] = reasoning or None
            finish_reason = choice.finish_reason
            if self.plan.tools.style is not None:
                parser = self._tool_call_parser()
                events = parser.feed(message["content"]) + parser.finish()
                message["content"], calls = message_of(events)
                if calls:
                    message["tool_calls"] = calls
                finish_reason = _finish_reason(finish_reason, parser)
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {
            "index": index,
            "text": choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }

    # -- a stream of server-sent events --

    def _chunks(self, index: int, outputs: list[TokenOutput]) -> list[dict]:
        """The streamed choice objects for consecutive outputs of choice `index` (their text
        joined): one, or for a chat one a delta (content, a call's name, its arguments), the
        last with the log-probabilities and finish reason; none where nothing is to be sent."""
        text = "".join(output.text for output in outputs)
        finish_reason = outputs[-1].finish_reason
        logprobs = None
        if self.want_logprobs:
            scored = [o for o in outputs if o.token_id >= 0 and not o.is_stop_token]
            logprobs = self._logprobs(scored) if scored else None
        if not self.chat:
            if not text and finish_reason is None and logprobs is None:
                return []
            return [
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            ]
        reasoning = ""
        if self.splitters is not None:
            splitter = self.splitters[index]
            if finish_reason is None:
                reasoning, text = splitter.feed(text)
            else:
                reasoning, text = splitter.split(text)
        if self.parsers is None:
            deltas = [{"content": text}] if text else []
        else:
            parser = self.parsers[index]
            events = parser.feed(text)
            if finish_reason is not None:
                events += parser.finish()
                finish_reason = _finish_reason(finish_reason, parser)
            deltas = deltas_of(events)
        if reasoning:
            deltas.insert(0, {"reasoning": reasoning})
        if not deltas and (finish_reason is not None or logprobs is not None):
            deltas = [{}]
        chunks = [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            for delta in deltas
        ]
        if chunks:
            chunks[-1].update(logprobs=logprobs, finish_reason=finish_reason)
        return chunks

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
            async for batch in self.events():
                for index, outputs in _by_choice(batch):
                    for chunk in self._chunks(index, outputs):
                        yield _sse({**header, "choices": [chunk], **extra})
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


def _finish_reason(finish_reason: str | None, parser: ToolCallParser) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended with calls, not cut short."""
    return "tool_calls" if finish_reason == "stop" and parser.num_calls else finish_reason


def _by_choice(batch: list[TokenOutput]) -> list[tuple[int, list[TokenOutput]]]:
    """A batch's outputs grouped by choice, in order of first appearance."""
    groups: dict[int, list[TokenOutput]] = {}
    for output in batch:
        groups.setdefault(output.choice, []).append(output)
    return list(groups.items())


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


class EventStream(StreamingResponse):
    """Server-sent events of one session; whatever ends it (the client leaving, the drain's
    grace period running out) frees the session's rows."""

    def __init__(self, session: Session) -> None:
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
