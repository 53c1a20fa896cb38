"""Tool calls through `lmforge serve` and the official `openai` client: `tools`, `tool_choice`
("auto", "none", "required", a named function) and `parallel_tool_calls` on
/v1/chat/completions, for a Qwen3-style template (`<tool_call>` blocks), a Llama-3.1-style one
(JSON calls) and a template that knows no tools (the generic fallback).

The models are random: they never call a tool by themselves, so "auto" is tested by the parser
over fixed texts, and "required" and a named choice end to end (the grammar makes even a random
model write a call whose arguments follow the tool's schema), an agent loop included: a forced
call, the test's answer as a `tool` message, the model's reply as a plain message. Streams put
together equal the whole responses.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lmforge.api import build_model, save_state  # noqa: E402
from lmforge.data.tokenizer import (  # noqa: E402
    LLAMA3_CHAT_TEMPLATE,
    load_tokenizer,
    render_llama3_chat,
    train_bpe,
)
from lmforge.serve.protocol import MAX_SCHEMA_BYTES, MAX_TOOLS  # noqa: E402
from lmforge.serve.tools import (  # noqa: E402
    GENERIC,
    HERMES,
    LLAMA_JSON,
    ToolCallParser,
    deltas_of,
    message_of,
    tool_call_style,
)
from tests.test_serve import (  # noqa: E402
    CORPUS,
    TOOL_CHOICES,
    Server,
    _check_answer,
    _field,
    assert_error_envelope,
    request,
)
from tests.test_serve import TOOLS as ANY_TOOLS  # noqa: E402
from tests.test_serve import message as any_message  # noqa: E402
from tests.train_utils import small_args, small_qwen3_args  # noqa: E402

CONTEXT = 2048
# Qwen3's layout: the tools in the system turn, calls as <tool_call> blocks, results as user
# turns of <tool_response> blocks (written for these tests in the shape of Qwen3's template)
QWEN3_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
{{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and " }}
{{- "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if (loop.first and message.content) or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
{%- elif thinking_only is defined and thinking_only %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""
# Llama 3.1's layout: the tools in the first user turn, a call as the assistant's whole turn
# `{"name": ..., "parameters": {...}}` (one a turn), results as ipython turns
LLAMA31_TEMPLATE = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- if tools is not none %}
{%- set first_user_message = messages[0].content | trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its ' }}
{{- 'proper arguments that best answers the given prompt.\n\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name ' }}
{{- 'and its value}. Do not use variables.\n\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}
{{- first_user_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim }}
{{- '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
# Short values (a random model writes strings for hundreds of tokens): enums, integers, a
# string by pattern
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "pattern": "^[CF]$"},
            },
            "required": ["city", "days"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def _artifact(root: Path, name: str, args, special_tokens=None, eos=None, template=None):
    """A random tiny model whose BPE tokenizer has `template` (None: train_bpe's Llama 3
    template, which knows no tools)."""
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    options = {} if special_tokens is None else {"special_tokens": special_tokens}
    out = root / f"tok-{name}"
    tokenizer = train_bpe([root / "corpus.txt"], vocab_size=320, out_dir=out, **options)
    if eos is not None or template is not None:
        config_file = out / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config.update({k: v for k, v in (("eos_token", eos), ("chat_template", template)) if v})
        config_file.write_text(json.dumps(config))
        (out / "chat_template.jinja").unlink(missing_ok=True)
        tokenizer = load_tokenizer(out)
    model = build_model(args, seed=7)
    return save_state(model.state_dict(), args, tokenizer, root / name, stage="test", parent=None)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers, started together: Qwen3 (its template), Llama (3.1's), Llama with train_bpe's
    template (no tools: the generic fallback)."""
    root = tmp_path_factory.mktemp("serve_tools")
    qwen_tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    artifacts = {
        "qwen3": _artifact(
            root, "qwen3", small_qwen3_args(320, max_seq_len=CONTEXT), qwen_tokens,
            "<|im_end|>", QWEN3_TEMPLATE,
        ),
        "llama31": _artifact(
            root, "llama31", small_args(320, max_seq_len=CONTEXT), template=LLAMA31_TEMPLATE
        ),
        "generic": _artifact(root, "generic", small_args(320, max_seq_len=CONTEXT)),
    }  # fmt: skip
    reasoning = {"qwen3": ["--reasoning-parser", "qwen3"]}
    started = {
        name: Server(
            Path(artifact), root / f"{name}.log", "--served-model-name", name,
            "--max-concurrency", "4", "--max-seq-len", str(CONTEXT), *reasoning.get(name, []),
        )
        for name, artifact in artifacts.items()
    }  # fmt: skip
    for name, server in started.items():
        server.artifact = artifacts[name]
    try:
        yield {name: server.wait_ready() for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def clients(servers):
    return {
        name: openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        for name, server in servers.items()
    }


ALL = ["qwen3", "llama31", "generic"]


def chat(client, model: str, **options):
    options = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, **options}
    return client.chat.completions.create(model=model, temperature=1.0, **options)


def check_calls(message, names=None) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each valid for its tool's schema."""
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    if names is not None:
        assert [name for name, _ in calls] == names
    return calls


# ---- the templates' styles and the prompts they render --------------------------------------


def test_each_template_is_read_in_its_style(servers):
    """Each template's style, and `--engine vllm`'s tool-call parser for it (hermes for
    Qwen3's blocks, llama3_json for Llama 3.1's JSON, none where vLLM has no parser)."""
    from lmforge.commands.serve import vllm_tool_parser

    parsers = {name: vllm_tool_parser(Path(server.artifact)) for name, server in servers.items()}
    assert parsers == {"qwen3": "hermes", "llama31": "llama3_json", "generic": None}
    tokenizers = {name: load_tokenizer(server.artifact) for name, server in servers.items()}
    assert tool_call_style(tokenizers["qwen3"]) is HERMES
    assert tool_call_style(tokenizers["llama31"]) is LLAMA_JSON
    assert tokenizers["generic"].chat_template == LLAMA3_CHAT_TEMPLATE  # knows no tools
    assert tool_call_style(tokenizers["generic"]) is GENERIC


def _prompt(server, messages, **fields) -> str:
    status, _, content = request(server, "POST", "/tokenize", {"messages": messages, **fields})
    assert status == 200, content
    status, _, content = request(
        server, "POST", "/detokenize", {"tokens": json.loads(content)["tokens"]}
    )
    return json.loads(content)["prompt"]


HISTORY = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


def test_tools_and_earlier_calls_reach_each_template(servers, clients):
    qwen = _prompt(servers["qwen3"], HISTORY, tools=TOOLS)
    assert json.dumps(WEATHER) in qwen and "You help.\n\n# Tools" in qwen
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n' in qwen
    )
    assert "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>" in qwen
    llama = _prompt(servers["llama31"], HISTORY, tools=TOOLS)
    assert "Environment: ipython" in llama and json.dumps(ADD, indent=4) in llama
    # the arguments reach the template as a dict: its tojson writes them once, not as a string
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}<|eot_id|>' in llama
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nSunny, 21 C<|eot_id|>" in llama
    generic = _prompt(servers["generic"], HISTORY, tools=TOOLS)
    assert "system<|end_header_id|>\n\nYou help.\n\n# Tools" in generic
    assert json.dumps(WEATHER) in generic
    assert (
        "<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "days": 1}})
        in generic
    )
    assert "user<|end_header_id|>\n\n<tool_response>\nSunny, 21 C\n</tool_response>" in generic
    # no tools, no tool turns: the prompt is what it always was
    assert _prompt(servers["generic"], MESSAGES) == render_llama3_chat(
        MESSAGES, add_generation_prompt=True
    )
    # vLLM's chat_template_kwargs reach the template (Qwen3's switch for its thinking)
    thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _prompt(servers["qwen3"], MESSAGES, **thinking_off).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert _prompt(servers["qwen3"], MESSAGES).endswith("<|im_start|>assistant\n")
    answer = chat(clients["qwen3"], "qwen3", max_tokens=2, extra_body=thinking_off)
    assert (
        answer.usage.prompt_tokens
        > chat(clients["qwen3"], "qwen3", max_tokens=2).usage.prompt_tokens
    )


def test_reasoning_parser_splits_the_thinking_out_of_the_content(clients):
    """`--reasoning-parser qwen3` on the Qwen3 server: a prompt that ends in `<think>` (a
    thinking-only template; here through chat_template_kwargs) makes the whole answer of the
    random model reasoning, never closed: `reasoning` holds it, streamed as `reasoning` deltas
    that join to the same text; without it the answer is content, as before."""
    client = clients["qwen3"]
    options = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    think = {"chat_template_kwargs": {"thinking_only": True}}
    answer = client.chat.completions.create(model="qwen3", extra_body=think, **options)
    message = answer.choices[0].message
    assert message.reasoning and message.content == ""
    stream = client.chat.completions.create(model="qwen3", extra_body=think, stream=True, **options)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert not "".join(d.content or "" for d in deltas)
    plain = client.chat.completions.create(model="qwen3", **options).choices[0].message
    assert plain.content and getattr(plain, "reasoning", None) is None


# ---- forced calls, end to end ---------------------------------------------------------------


@pytest.mark.parametrize("model", ALL)
def test_required_writes_one_valid_call(clients, model):
    for seed in range(3):
        choice = chat(
            clients[model], model, tool_choice="required", parallel_tool_calls=False, seed=seed
        ).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(check_calls(choice.message)) == 1


@pytest.mark.parametrize("model", ALL)
def test_a_named_function_is_the_one_called(clients, model):
    named = {"type": "function", "function": {"name": "add"}}
    choices = chat(clients[model], model, tool_choice=named, n=2, seed=1).choices
    for choice in choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message, ["add"])


def test_required_may_write_several_calls_where_the_style_allows(clients):
    """Qwen3's layout: one or more calls; Llama's template takes one a turn."""
    for model, most in (("qwen3", 8), ("llama31", 1)):
        counts = []
        for seed in range(4):
            choice = chat(clients[model], model, tool_choice="required", seed=seed).choices[0]
            assert choice.finish_reason == "tool_calls"
            counts.append(len(check_calls(choice.message)))
        assert max(counts) <= most and (max(counts) > 1) == (most > 1), counts


def _streamed(client, model: str, **options):
    """A stream's deltas put together: (content, [(id, name, arguments)], finish reasons)."""
    content, calls, reasons = "", {}, []
    for chunk in chat(client, model, stream=True, **options):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                if call.id is not None:  # a call's first delta: its id, name, no arguments yet
                    assert call.index == len(calls) and call.type == "function"
                    assert call.function.arguments == ""
                    calls[call.index] = [call.id, call.function.name, ""]
                else:
                    assert call.function.name is None
                    calls[call.index][2] += call.function.arguments
            reasons.append(choice.finish_reason)
    return content or None, [tuple(call) for call in calls.values()], reasons


@pytest.mark.parametrize("model", ALL)
def test_a_stream_puts_together_the_same_calls(clients, model):
    options = {"tool_choice": "required", "seed": 5}
    content, calls, reasons = _streamed(clients[model], model, **options)
    whole = chat(clients[model], model, **options).choices[0]
    assert reasons[-1] == whole.finish_reason == "tool_calls"
    assert [r for r in reasons[:-1] if r is not None] == []
    assert content == whole.message.content
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(name, arguments) for _, name, arguments in calls] == expected
    assert all(id.startswith("call_") for id, _, _ in calls)


@pytest.mark.parametrize("model", ALL)
def test_an_agent_loop_call_answer_reply(clients, model):
    """The model calls a tool (forced), the test answers, the model replies in text."""
    client = clients[model]
    messages = list(MESSAGES)
    called = chat(client, model, messages=messages, tool_choice="required", seed=2)
    message = called.choices[0].message
    assert check_calls(message)
    messages.append(message)  # the client's own object, as OpenAI's examples do
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    for tool_choice in ("none", "auto"):
        reply = chat(client, model, messages=messages, tool_choice=tool_choice, seed=3,
                     max_tokens=20).choices[0]  # fmt: skip
        assert reply.finish_reason in ("stop", "length")
        assert reply.message.tool_calls is None and isinstance(reply.message.content, str)


# ---- "auto": calls read out of fixed texts ---------------------------------------------------

ARGS = json.dumps({"city": "Paris", "n": [1, {"a": '}\\"{'}]})  # brackets in a string
PARSED = [
    # (style, the model's text, content, [(name, arguments)])
    (HERMES, f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n'
     '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", ARGS), ("add", "{}")]),
    (HERMES, "no calls, trailing space \n", "no calls, trailing space \n", []),
    (HERMES, "<tool_call> is not followed by JSON", "<tool_call> is not followed by JSON", []),
    (HERMES, 'a <tool_call>\n{"x": 1}\n</tool_call> b', 'a <tool_call>\n{"x": 1}\n</tool_call> b',
     []),
    (HERMES, '<tool_call>\n{"arguments": {"q": 1}, "name": "f"}\n</tool_call>\nDone.', "Done.",
     [("f", '{"q": 1}')]),
    (HERMES, '<tool_call>\n{"name": "f", "parameters": {"q": "cut sh', None,
     [("f", '{"q": "cut sh')]),  # max_tokens: the arguments so far
    (HERMES, "text, then a marker cut short <tool_ca", "text, then a marker cut short <tool_ca",
     []),
    (HERMES, '<tool_call>\n{"name": "caf\\u00e9", "arguments": {}}</tool_call>', None,
     [("café", "{}")]),
    (LLAMA_JSON, '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x"}}',
     None, [("f", '{"a": 1}'), ("g", '{"b": "x"}')]),
    (LLAMA_JSON, '<|python_tag|>{"name": "f", "arguments": {"a": [1, 2]}}', None,
     [("f", '{"a": [1, 2]}')]),
    (LLAMA_JSON, '  Hello {"name": "f"}', '  Hello {"name": "f"}', []),
    (LLAMA_JSON, '{"a": 1} is JSON, not a call', '{"a": 1} is JSON, not a call', []),
    (LLAMA_JSON, '{"name": "f", "parameters": {}} and a remark', "and a remark",
     [("f", "{}")]),
]  # fmt: skip


@pytest.mark.parametrize("style, text, content, calls", PARSED)
def test_auto_reads_calls_whole_and_token_by_token_alike(style, text, content, calls):
    whole = ToolCallParser(style)
    whole_events = whole.feed(text) + whole.finish()
    streamed = ToolCallParser(style)
    events = [event for char in text for event in streamed.feed(char)] + streamed.finish()
    for got in (whole_events, events):
        got_content, got_calls = message_of(got)
        assert got_content == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    deltas = deltas_of(events)
    heads = [d["tool_calls"][0] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
    assert [(h["index"], h["function"]["arguments"]) for h in heads] == [
        (i, "") for i in range(len(calls))
    ]
    assert len(deltas) < len(text) / 2 + 3  # consecutive pieces of one kind are joined


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = PARSED[0][1]
    parser = ToolCallParser(HERMES, max_calls=1)
    content, calls = message_of(parser.feed(text) + parser.finish())
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]


# ---- client mistakes: 400s naming the parameter ----------------------------------------------


def _tool(name="f", parameters=None, **function):
    function = {"name": name, **function}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


NAMED_G = {"type": "function", "function": {"name": "g"}}
NAMED_ADD = {"type": "function", "function": {"name": "add"}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD_TOOLS = [
    # (request fields, param, a piece of the message)
    ({"tools": {"type": "function"}}, "tools", "list"),
    ({"tools": []}, "tools", "at least 1"),
    ({"tools": ["f"]}, "tools[0]", "object"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "missing"),
    ({"tools": [_tool("a b")]}, "tools[0].function.name", "pattern"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "function"),
    ({"tools": [_tool(parameters=[1])]}, "tools[0].function.parameters", "dictionary"),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters",
     "an object"),
    ({"tools": [_tool(parameters={"type": "object", "properties": {"a": {"type": "objekt"}}})]},
     "tools[0].function.parameters", 'Unsupported type "objekt"'),
    ({"tools": [_tool(), _tool("g", {"$ref": "#/$defs/missing"})]},
     "tools[1].function.parameters", "missing"),
    ({"tools": [_tool(), _tool()]}, "tools[1].function.name", "named 'f'"),
    ({"tools": [_tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools", f"at most {MAX_TOOLS}"),
    ({"tools": [_tool(f"f{i}", {"enum": ["x" * 1000] * 9}) for i in range(8)]}, "tools",
     f"at most {MAX_SCHEMA_BYTES}"),
    ({"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice", "'required'"),
    ({"tools": [_tool()], "tool_choice": NAMED_G}, "tool_choice", "not in 'tools'"),
    ({"tools": [_tool()], "tool_choice": {"type": "function"}}, "tool_choice.function",
     "missing"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [_tool()], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "tool calls"),
    ({"tools": [_tool()], "tool_choice": "required", "min_tokens": 2}, "min_tokens",
     "forced tool call"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
     "messages[1]", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0]",
     "only an assistant"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
      "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
]  # fmt: skip


@pytest.mark.parametrize("fields, param, message", BAD_TOOLS)
def test_bad_tools_are_400s_naming_the_parameter(servers, fields, param, message):
    body = {"model": "generic", "messages": MESSAGES, "max_tokens": 4, **fields}
    status, _, content = request(servers["generic"], "POST", "/v1/chat/completions", body)
    assert status == 400, content
    assert message in assert_error_envelope(content, param)["message"]


def test_what_a_template_refuses_is_a_400_naming_messages(servers):
    """Llama's template takes one call a turn: two are the client's mistake, not a 5xx."""
    two_calls = {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "c2"}]}
    body = {"model": "llama31", "messages": [*MESSAGES, two_calls], "tools": [_tool()]}
    status, _, content = request(servers["llama31"], "POST", "/v1/chat/completions", body)
    assert status == 400, content
    assert "single tool-calls" in assert_error_envelope(content, "messages")["message"]


@pytest.mark.parametrize("model", ALL)
def test_fuzzed_tool_requests_never_get_a_5xx(servers, model):
    """Tools, choices and tool turns of any shape (tests/test_serve.py's strategies), on each
    style: a 4xx or an answer, never a 5xx."""
    statuses = collections.Counter()
    bodies = st.fixed_dictionaries(
        {
            "model": st.just(model),
            "messages": st.just(MESSAGES) | st.lists(any_message, min_size=1, max_size=3),
            "max_tokens": st.integers(1, 6),
        },
        optional={
            "tools": st.just(TOOLS) | _field(ANY_TOOLS),
            "tool_choice": _field(TOOL_CHOICES),
            "parallel_tool_calls": _field(st.booleans()),
            "stream": st.booleans(),
            "n": st.integers(1, 2),
        },
    )

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=bodies)
    def check(body):
        route = "/v1/chat/completions"
        status, headers, content = request(servers[model], "POST", route, body)
        _check_answer(status, headers, content, body.get("stream") is True)
        statuses[status] += 1

    for number, tool_choice in enumerate(["required", NAMED_ADD, "auto", "none"]):
        body = {"model": model, "messages": HISTORY, "max_tokens": 6, "tools": TOOLS}
        body.update(tool_choice=tool_choice, stream=number % 2 == 1)
        check = example(body=body)(check)
    check()
    print(model, sorted(statuses.items()))
    assert statuses[200] >= 4 and statuses[400] >= 4
