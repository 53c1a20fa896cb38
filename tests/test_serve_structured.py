"""Structured output through `lmforge serve` and the official `openai` client: `response_format`
json_schema and json_object on /v1/chat/completions and /v1/completions, streamed or not, beside
unconstrained requests; bad schemas are 400s naming 'response_format'. The model is random: its
own text is garbage, so JSON that parses and follows the schema comes from the constraint."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from lmforge.api import build_model, save_state  # noqa: E402
from lmforge.data.tokenizer import train_bpe  # noqa: E402
from lmforge.serve.protocol import MAX_SCHEMA_BYTES  # noqa: E402
from tests.test_serve import CORPUS, Server, assert_error_envelope, request  # noqa: E402
from tests.test_structured_output import SCHEMA  # noqa: E402
from tests.train_utils import small_args  # noqa: E402

MODEL = "tiny-json"
CONTEXT = 512
MESSAGES = [{"role": "user", "content": "Your pet as JSON, please."}]
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    """One server (HTTP in a process of its own) over a random tiny model and BPE tokenizer."""
    root = tmp_path_factory.mktemp("serve_structured")
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    tokenizer = train_bpe([root / "corpus.txt"], vocab_size=320, out_dir=root / "tok")
    args = small_args(320, max_seq_len=CONTEXT)
    artifact = save_state(
        build_model(args, seed=7).state_dict(), args, tokenizer, root / MODEL, stage="test",
        parent=None,
    )  # fmt: skip
    started = Server(
        Path(artifact), root / "server.log", "--served-model-name", MODEL,
        "--max-concurrency", "4", "--max-seq-len", str(CONTEXT),
    )  # fmt: skip
    try:
        yield started.wait_ready()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def chat_json(client, **options):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=JSON_SCHEMA, max_tokens=300, **options
    )


def test_json_schema_at_temperature_1_parses_and_validates(client):
    for seed in range(4):
        choice = chat_json(client, temperature=1.0, seed=seed).choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    garbage = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=0
    )
    with pytest.raises(ValueError):  # the same model without the constraint
        json.loads(garbage.choices[0].message.content)


def test_json_object_on_chat_and_completions(client):
    greedy = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, temperature=0
    )
    assert isinstance(json.loads(greedy.choices[0].message.content), dict)
    # Keys of any object are strings of any length: most seeds write past max_tokens (what
    # finishes here is "{}", then a stop token, from a model whose own text is garbage).
    stopped = 0
    for seed in range(8):
        choice = client.completions.create(
            model=MODEL, prompt="The cat sat", max_tokens=200, temperature=1.0, seed=seed,
            extra_body={"response_format": {"type": "json_object"}},
        ).choices[0]  # fmt: skip
        assert choice.text.startswith("{")
        if choice.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(choice.text), dict)
    assert stopped >= 2


def test_json_schema_on_completions(client):
    for seed in range(2):
        choice = client.completions.create(
            model=MODEL, prompt="The cat sat", max_tokens=300, temperature=1.0, seed=seed,
            extra_body={"response_format": JSON_SCHEMA},
        ).choices[0]  # fmt: skip
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_a_stream_writes_the_same_json(client):
    stream = chat_json(client, temperature=1.0, seed=5, stream=True)
    pieces, finish_reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish_reasons.append(choice.finish_reason)
    text = "".join(pieces)
    assert finish_reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == chat_json(client, temperature=1.0, seed=5).choices[0].message.content


def test_a_constrained_request_beside_an_unconstrained_one(client):
    """Both finish, at once, and the greedy unconstrained text is what it is alone."""

    def unconstrained():
        return client.completions.create(
            model=MODEL, prompt="A dog ran", max_tokens=80, temperature=0
        ).choices[0]

    alone = unconstrained()
    results = {}
    threads = [
        threading.Thread(target=lambda: results.update(json=chat_json(client, seed=3))),
        threading.Thread(target=lambda: results.update(text=unconstrained())),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results["text"].text == alone.text and results["text"].finish_reason == "length"
    jsonschema.validate(json.loads(results["json"].choices[0].message.content), SCHEMA)


def test_max_tokens_mid_json_is_finish_reason_length_with_the_partial_text(client):
    choice = chat_json(client, temperature=0, max_completion_tokens=6).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content and '{"name": "'.startswith(choice.message.content)


BAD_FORMATS = [
    # (request body fields, param, a piece of the message)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
      "schema": {"type": "objekt"}}}}, "response_format", 'Unsupported type "objekt"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
      "schema": {"$ref": "#/$defs/missing"}}}}, "response_format", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
      "enum": ["x" * 1000] * (MAX_SCHEMA_BYTES // 1000 + 1)}}}}, "response_format",
     f"at most {MAX_SCHEMA_BYTES}"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' is required"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
     "response_format", "only there"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens", "min_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("fields, param, message", BAD_FORMATS)
def test_bad_response_formats_are_400s_naming_the_parameter(server, route, fields, param, message):
    body = {"model": MODEL, "max_tokens": 8, **fields}
    body.update({"messages": MESSAGES} if "chat" in route else {"prompt": "The cat"})
    status, _, content = request(server, "POST", route, body)
    assert status == 400, content
    assert message in assert_error_envelope(content, param)["message"]
