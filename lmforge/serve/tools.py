"""Tool calls on /v1/chat/completions: how a request's tools and a chat's earlier calls reach the
model, what "required" or a named `tool_choice` constrains it to write, and how its text becomes
`message.tool_calls`.

A model writes calls in the format its chat template teaches (`ToolCallStyle`, found from the
template: `tool_call_style`):
- HERMES, Qwen3's (and Hermes's): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
  blocks, text allowed around them; the template lists the tools and renders earlier calls;
- LLAMA_JSON, Llama 3.1+'s: the answer is `{"name": ..., "parameters": {...}}` (further calls
  after "; ", as vLLM reads them; Llama's template takes one call a turn, so "required" writes one);
- GENERIC, for a template that knows no tools: HERMES's calls, with the tool list rendered here
  into the system message and earlier calls and tool results into the messages' text.

"required" and a named tool_choice reach the engine as a grammar (a tagged `JsonFormat`, see
lmforge/generate/grammar.py): the text is then one or more calls in the style's layout whose
arguments the tool's `parameters` schema allows. "auto" lets the model choose: `ToolCallParser`
reads the calls out of whatever it wrote, as the text streams (OpenAI's deltas) or all at once.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from lmforge.generate.grammar import JsonFormat, TaggedJson
from lmforge.serve.protocol import (
    MAX_SCHEMA_BYTES,
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    Tool,
)


@dataclass(frozen=True)
class ToolCallStyle:
    """How a model writes its calls.

    Args:
        name: for messages and logs.
        start, end: the text around each call's JSON object (start None: the answer itself
            starts with the object; end "": nothing after it).
        arguments_key: the object's key for the arguments ("arguments" or "parameters").
        separator: between calls that "required" makes it write.
        parallel: whether "required" may write more than one call.
        renders_tools: whether the chat template lists the tools and renders earlier calls and
            tool results itself (else this module does, into the messages).
    """

    name: str
    start: str | None
    end: str
    arguments_key: str
    separator: str
    parallel: bool
    renders_tools: bool

    def call_begin(self, function_name: str) -> str:
        """The text of a call up to its arguments (as the grammar forces it)."""
        head = f"{self.start}\n" if self.start else ""
        return f'{head}{{"name": "{function_name}", "{self.arguments_key}": '

    @property
    def call_end(self) -> str:
        return "}" + (f"\n{self.end}" if self.end else "")


HERMES = ToolCallStyle("hermes", "<tool_call>", "</tool_call>", "arguments", "\n", True, True)
LLAMA_JSON = ToolCallStyle("llama_json", None, "", "parameters", "; ", False, True)
GENERIC = replace(HERMES, name="generic", renders_tools=False)

# The generic style's system text (the Hermes function-calling prompt, in our words).
GENERIC_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "The functions are listed within <tools></tools> XML tags, one a line:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, write a JSON object with the function's name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
PYTHON_TAG = "<|python_tag|>"  # what Llama may write before a JSON call


def tool_call_style(tokenizer) -> ToolCallStyle:
    """The style a tokenizer's chat template teaches: HERMES or LLAMA_JSON where the template
    reads `tools` and shows that layout, else GENERIC (also without a template)."""
    if "tools" not in tokenizer.chat_template_variables():
        return GENERIC
    if HERMES.start in tokenizer.chat_template:
        return HERMES
    if '"parameters"' in tokenizer.chat_template:
        return LLAMA_JSON
    return GENERIC


# ---- the chat as the template takes it ------------------------------------------------------


def template_messages(
    messages: list[ChatMessage], tools: list[Tool] | None, style: ToolCallStyle
) -> tuple[list[dict], dict]:
    """The chat's messages as the template takes them, and its extra variables: `tools` (the
    definitions as transformers' apply_chat_template passes them) where it lists them itself."""
    rendered = [_message(message, index, style) for index, message in enumerate(messages)]
    if not tools:
        return rendered, {}
    definitions = [tool.model_dump(exclude_none=True) for tool in tools]
    if style.renders_tools:
        return rendered, {"tools": definitions}
    return _with_tool_list(rendered, definitions), {}


def _message(message: ChatMessage, index: int, style: ToolCallStyle) -> dict:
    """One message: text parts joined, a developer's message a system one; tool fields as
    transformers' templates read them (a call's arguments a dict), or as text (GENERIC)."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    content = content or ""
    role = "system" if message.role == "developer" else message.role
    calls = [
        (call.function.name, call.id, _arguments(call.function.arguments, index, number))
        for number, call in enumerate(message.tool_calls or ())
    ]
    if not style.renders_tools:
        if role == "tool":  # a template without tools may not know the role
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        texts = [_generic_call_text(name, arguments) for name, _, arguments in calls]
        return {"role": role, "content": "\n".join([content, *texts] if content else texts)}
    rendered = {"role": role, "content": content}
    if calls:
        rendered["tool_calls"] = [
            {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, id, arguments in calls
        ]
    if role == "tool":
        rendered["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            rendered["name"] = message.name
    return rendered


def _arguments(text: str, index: int, number: int) -> dict:
    """A call's arguments (JSON text on the wire) as the dict templates expect."""
    try:
        arguments = json.loads(text)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        param = f"messages[{index}].tool_calls[{number}].function.arguments"
        raise ApiError(
            400, f"'{param}' must be a JSON object's text", param=param, code="invalid_value"
        )
    return arguments


def _generic_call_text(name: str, arguments: dict) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{GENERIC.start}\n{call}\n{GENERIC.end}"


def _with_tool_list(messages: list[dict], definitions: list[dict]) -> list[dict]:
    """The tool list in the system message (after its own text), or in a new one first."""
    listed = "\n".join(json.dumps(d, ensure_ascii=False) for d in definitions)
    prompt = GENERIC_TOOLS_PROMPT.format(tools=listed)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        text = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": text}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


# ---- what a request's tools ask for ----------------------------------------------------------


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools ask of the server.

    Args:
        listed: the tools the template (or GENERIC's system text) lists; None: none.
        style: the answer's calls are read in this style; None: the answer is text.
        forced: the grammar of "required" or a named tool_choice; None: the model chooses.
        max_calls: the most calls read from the answer (1 with `parallel_tool_calls: false`).
        schemas: each tool's `parameters`, to be checked (xgrammar must be able to follow
            them, whatever the choice: a bad tool is the client's mistake either way).
    """

    listed: list[Tool] | None = None
    style: ToolCallStyle | None = None
    forced: JsonFormat | None = None
    max_calls: int | None = None
    schemas: tuple[JsonFormat, ...] = ()


def tool_use(body: ChatCompletionRequest, tokenizer) -> ToolUse:
    """Check a chat request's `tools` and `tool_choice` (400s naming them) and say what they
    ask for. "none" lists no tools and reads no calls; the tools are checked all the same."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(
                400,
                "'tool_choice' other than 'none' or 'auto' needs 'tools' to choose from",
                param="tool_choice",
                code="invalid_value",
            )
        return ToolUse()
    _check_tools(tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if all(tool.function.name != name for tool in tools):
            raise ApiError(
                400,
                f"tool_choice names the function {name!r}, which is not in 'tools'",
                param="tool_choice",
                code="invalid_value",
            )
    schemas = tuple(JsonFormat.of(tool_parameters(tool)) for tool in tools)
    if choice == "none":
        return ToolUse(schemas=schemas)
    style = tool_call_style(tokenizer)
    forced = forced_calls(tools, choice, body.parallel_tool_calls, style)
    max_calls = 1 if body.parallel_tool_calls is False else None
    return ToolUse(tools, style, forced, max_calls, schemas)


def _check_tools(tools: list[Tool]) -> None:
    """Distinct names, object schemas, all of them within MAX_SCHEMA_BYTES."""
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise ApiError(
                400,
                f"two tools are named {name!r}; each function needs a name of its own",
                param=f"tools[{index}].function.name",
                code="invalid_value",
            )
        seen.add(name)
        kind = tool_parameters(tool).get("type", "object")
        if kind != "object":
            param = f"tools[{index}].function.parameters"
            raise ApiError(
                400,
                f"'{param}' must be a JSON schema of an object (the arguments); its type is "
                f"{json.dumps(kind)}",
                param=param,
                code="invalid_value",
            )
    size = len(json.dumps([tool.model_dump(exclude_none=True) for tool in tools]).encode())
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(
            400,
            f"the tools' JSON has {size} bytes; at most {MAX_SCHEMA_BYTES}",
            param="tools",
            code="invalid_value",
        )


# ---- what "required" and a named tool_choice force -------------------------------------------


def forced_calls(
    tools: list[Tool],
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
    style: ToolCallStyle,
) -> JsonFormat | None:
    """The grammar of the calls "required" (one or more of any tool; one where the style or
    `parallel_tool_calls: false` says so) or a named tool_choice (one call of it) asks for;
    None for "auto" and "none"."""
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == tool_choice.function.name]
        single = True
    elif tool_choice == "required":
        chosen = tools
        single = not style.parallel or parallel_tool_calls is False
    else:
        return None
    tagged = tuple(
        TaggedJson(
            style.call_begin(tool.function.name),
            json.dumps(tool_parameters(tool), ensure_ascii=False),
            style.call_end,
        )
        for tool in chosen
    )
    return JsonFormat(tagged=tagged, separator=style.separator, single=single)


def tool_parameters(tool: Tool) -> dict:
    """The schema a tool's arguments follow: its `parameters`, an object even where they do
    not say (a call's arguments are an object in every style)."""
    parameters = tool.function.parameters
    return {"type": "object"} if parameters is None else {"type": "object", **parameters}


# ---- reading calls out of the text ----------------------------------------------------------

# A call's JSON up to its arguments, as models and the grammar write it (keys in this order);
# only once the arguments have begun, so that they never start with whitespace.
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


def _json_string(escaped: str) -> str:
    """A JSON string's value from the text between its quotes."""
    try:
        return json.loads(f'"{escaped}"')
    except ValueError:  # a bad escape: the text as written
        return escaped


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that `marker` starts with (a marker that may
    be arriving)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ToolCallParser:
    """Reads a model's text, as it comes, into events: ("content", text), ("call", index, id,
    name) when a call's name is known, ("arguments", index, text) as its arguments' JSON text
    arrives. The same events whether the text comes in one piece or token by token, so a
    stream's deltas put together are the whole response's message.

    Whitespace right before and after calls is theirs, not content; text that looked like a
    call and was not is content; a call cut short (max_tokens) keeps the arguments it has.
    With `max_calls`, calls past that many are left out (`parallel_tool_calls: false` under
    "auto": the first only, as vLLM does).
    """

    def __init__(self, style: ToolCallStyle, *, max_calls: int | None = None) -> None:
        self.style = style
        self.max_calls = max_calls
        self.text = ""  # all text fed so far
        self.pos = 0  # where the text not yet accounted for starts
        self.state = "text" if style.start else "start"
        self.num_calls = 0
        self._held = ""  # whitespace after the content so far: a call's, if one follows
        self._events: list[tuple] = []

    def feed(self, text: str) -> list[tuple]:
        """The events `text` (what follows the text fed before) completes."""
        self.text += text
        while getattr(self, f"_{self.state}")():
            pass
        return self._take_events()

    def finish(self) -> list[tuple]:
        """The last events, at the end of the text."""
        rest = self.text[self.pos :]
        if self.state in ("text", "plain", "start"):
            self._content(rest)
        elif self.state == "open" or (self.state == "call" and not self._announced):
            self._content(self.text[self._call_from :])  # not a call after all: text
        self.state = "done"
        if self._held and not self.num_calls:
            self._events.append(("content", self._held))
        self._held = ""
        return self._take_events()

    def _take_events(self) -> list[tuple]:
        events, self._events = self._events, []
        if self.max_calls is None:
            return events
        return [event for event in events if event[0] == "content" or event[1] < self.max_calls]

    # each state's step: True where it moved on (and the next state should look), False where
    # it needs more text

    def _done(self) -> bool:
        return False

    def _text(self) -> bool:
        """Content, until a call's start marker."""
        rest = self.text[self.pos :]
        found = rest.find(self.style.start)
        if found < 0:
            ready = len(rest) - _partial_suffix(rest, self.style.start)
            self._content(rest[:ready])
            self.pos += ready
            return False
        self._content(rest[:found])
        self._call_from = self.pos + found
        self.pos += found + len(self.style.start)
        self.state = "open"
        return True

    def _open(self) -> bool:
        """After a start marker: the call's object, or text after all."""
        rest = self.text[self.pos :]
        body = rest.lstrip()
        if not body:
            return False
        self.pos += len(rest) - len(body)
        if body[0] == "{":
            self._begin_call()
        else:
            self._content(self.text[self._call_from : self.pos])
            self.state = "text"
        return True

    def _start(self) -> bool:
        """LLAMA_JSON's answer: a call if it starts with an object, else content."""
        rest = self.text[self.pos :]
        body = rest.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(body):  # (also: nothing but whitespace yet)
            return False
        if not body:
            return False
        if body[0] == "{":
            self._call_from = self.pos
            self.pos = len(self.text) - len(body)
            self._begin_call()
        else:
            self.state = "plain"
        return True

    def _plain(self) -> bool:
        """LLAMA_JSON's text that is not calls: content to the end."""
        self._content(self.text[self.pos :])
        self.pos = len(self.text)
        return False

    def _content(self, text: str) -> None:
        """Content, but for its trailing whitespace: held until text follows (no call)."""
        text = self._held + text
        kept = text.rstrip()
        if kept:
            self._events.append(("content", kept))
        self._held = text[len(kept) :]

    def _begin_call(self) -> None:
        self.state = "call"
        self._announced = False
        self._rescan(self.pos, depth=0)

    def _rescan(self, at: int, *, depth: int) -> None:
        self._scanned, self._depth = at, depth
        self._in_string = self._escape = False
        self._arguments_from = self._arguments_to = self._closed_at = None
        self._sent = 0

    def _call(self) -> bool:
        """Inside a call's object: its name, then its arguments as they come."""
        self._scan()
        if not self._announced:
            head = _CALL_HEAD.match(self.text, self.pos)
            if head is not None:
                self._announce(_json_string(head.group(1)))
                self._rescan(head.end(), depth=1)  # the arguments' end is known from here
                self._arguments_from = head.end()
                self._scan()
        if self._announced:
            self._send_arguments()
        if self._closed_at is None:
            return False
        end = self._closed_at + 1
        if not self._announced and not self._announce_whole(self.text[self.pos : end]):
            self._content(self.text[self._call_from : end])  # not a call: text
            self.state = "text" if self.style.start else "plain"
        else:
            self.state = "close" if self.style.end else "between"
        self.pos = end
        return True

    def _scan(self) -> None:
        """JSON depth over the text not scanned yet: where the arguments and the object end."""
        text, depth = self.text, self._depth
        for at in range(self._scanned, len(text)):
            char = text[at]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
                continue
            # the arguments end where the call's object goes on or closes
            arguments_from = self._arguments_from
            ends = depth == 1 and char in ",}" and self._arguments_to is None
            if ends and arguments_from is not None and at >= arguments_from:
                self._arguments_to = at
            if char == '"':
                self._in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    self._depth, self._scanned, self._closed_at = 0, at + 1, at
                    return
        self._depth, self._scanned = depth, len(text)

    def _announce(self, name: str) -> None:
        self._events.append(("call", self.num_calls, f"call_{uuid.uuid4().hex[:24]}", name))
        self.num_calls += 1
        self._announced = True
        self._held = ""  # the whitespace before a call is not content

    def _send_arguments(self) -> None:
        end = self._scanned if self._arguments_to is None else self._arguments_to
        arguments = self.text[self._arguments_from : end].rstrip()
        if len(arguments) > self._sent:
            self._events.append(("arguments", self.num_calls - 1, arguments[self._sent :]))
            self._sent = len(arguments)

    def _announce_whole(self, text: str) -> bool:
        """A complete object whose keys came in another order: a call if it has a name."""
        try:
            call = json.loads(text)
        except ValueError:
            return False
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return False
        arguments = call.get("arguments", call.get("parameters", {}))
        self._announce(call["name"])
        self._events.append(
            ("arguments", self.num_calls - 1, json.dumps(arguments, ensure_ascii=False))
        )
        return True

    def _close(self) -> bool:
        """After a HERMES call's object: its end marker."""
        rest = self.text[self.pos :]
        body = rest.lstrip()
        if body.startswith(self.style.end):
            self.pos += len(rest) - len(body) + len(self.style.end)
            self.state = "gap"
        elif self.style.end.startswith(body):
            return False
        else:
            self.state = "text"
        return True

    def _gap(self) -> bool:
        """After a HERMES call: whitespace (the call's), then text or another call."""
        rest = self.text[self.pos :]
        body = rest.lstrip()
        self.pos += len(rest) - len(body)
        if not body:
            return False
        self.state = "text"
        return True

    def _between(self) -> bool:
        """After a LLAMA_JSON call: another after "; ", or text."""
        rest = self.text[self.pos :]
        body = rest.lstrip(" \t\r\n;")
        if not body:
            return False
        self.pos += len(rest) - len(body)
        if body[0] == "{":
            self._call_from = self.pos
            self._begin_call()
        else:
            self.state = "plain"
        return True


def message_of(events: list[tuple]) -> tuple[str | None, list[dict]]:
    """A whole response's content (None where it has calls and no other text) and calls."""
    content, calls = [], []
    for event in events:
        if event[0] == "content":
            content.append(event[1])
        elif event[0] == "call":
            function = {"name": event[3], "arguments": ""}
            calls.append({"id": event[2], "type": "function", "function": function})
        else:
            calls[event[1]]["function"]["arguments"] += event[2]
    text = "".join(content)
    return (text or None) if calls else text, calls


def deltas_of(events: list[tuple]) -> list[dict]:
    """A stream's deltas for events, as OpenAI sends them: content; a call's id, type and name
    with arguments ""; then its arguments' text (consecutive pieces of one kind joined)."""
    deltas: list[dict] = []
    for event in events:
        last = deltas[-1] if deltas else {}
        if event[0] == "content":
            if "content" in last:
                last["content"] += event[1]
            else:
                deltas.append({"content": event[1]})
        elif event[0] == "call":
            _, index, id, name = event
            function = {"name": name, "arguments": ""}
            call = {"index": index, "id": id, "type": "function", "function": function}
            deltas.append({"tool_calls": [call]})
        else:
            _, index, text = event
            calls = last.get("tool_calls")
            if calls and "id" not in calls[0] and calls[0]["index"] == index:
                calls[0]["function"]["arguments"] += text
            else:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
    return deltas
