"""Structured output in the engine: the grammar's mask on constrained rows only, the vocabulary
xgrammar matches against, sequences that end where their JSON does, and the errors a user can act
on. The model is random: its unconstrained text is garbage, so JSON that parses and follows its
schema comes from the mask."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lmforge.api import build_model
from lmforge.data.tokenizer import TiktokenTokenizer, train_bpe
from lmforge.errors import ConfigError
from lmforge.generate import Engine, SamplingParams
from lmforge.generate import grammar as grammar_module
from lmforge.generate.grammar import Grammars, JsonFormat, check_json_format
from lmforge.generate.sampling import mask_disallowed
from tests.test_generate import one_thread  # noqa: F401 (its autouse fixture: one thread)
from tests.train_utils import small_args

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

CORPUS = (
    "The cat sat on the mat. A dog ran in the park and the sun was warm.\n"
    "Models learn from text; tokens are pieces of words. Hello, world!\n"
) * 40
# Nested objects, an array of enums, required keys; strings by pattern (a string of any length
# from a random model runs for hundreds of tokens)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["cat", "dog", "sun"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"}},
            "required": ["kind", "legs"],
        },
    },
    "required": ["name", "age", "tags", "pet"],
}
CHAT = [{"role": "user", "content": "Your pet as JSON, please."}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    return train_bpe([root / "corpus.txt"], vocab_size=320, out_dir=root / "tokenizer")


@pytest.fixture(scope="module")
def model(tokenizer):
    # a vocabulary of 384 for a tokenizer of 320: the grammar never allows the 64 extra ids
    return build_model(small_args(384, max_seq_len=512), seed=7).eval()


def run(engine: Engine, sequences) -> None:
    engine.add(sequences)
    while engine.has_work:
        engine.step()


def test_the_mask_sets_the_disallowed_tokens_of_constrained_rows_only():
    logits = torch.randn(4, 70)  # 70 tokens: three words of bits, the last one partly used
    rows = torch.tensor([1, 3])
    allowed = torch.rand(2, 96) < 0.3
    bitmask = (allowed.view(2, 3, 32).int() << torch.arange(32)).sum(-1).int()  # [2, 3]
    masked = mask_disallowed(logits, rows, bitmask)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # bit for bit
    for row, constrained in zip(rows.tolist(), allowed):
        expected = logits[row].masked_fill(~constrained[:70], float("-inf"))
        assert torch.equal(masked[row], expected)
    assert torch.isfinite(logits).all()  # a new tensor: the logits stay


def test_token_bytes_spell_what_the_tokenizer_decodes(tokenizer):
    ranks = {bytes([b]): b for b in range(256)}
    for merged in (b"Th", b"The", b" c", b"at", b" cat", b"or", b"ld"):
        ranks[merged] = len(ranks)
    for tok in (tokenizer, TiktokenTokenizer(ranks)):
        entries = tok.token_bytes()
        assert len(entries) == tok.vocab_size
        assert all(entries[i] == b"" for i in tok.special_tokens.values())
        text = 'The cat sat; Hello, world! {"a": [1, 2]}\n'
        ids = tok.encode(text)
        assert b"".join(entries[i] for i in ids).decode() == tok.decode(ids) == text


def constrained_beside_greedy(model, tokenizer, *, overlap: bool) -> list[str]:
    """Two seeded temperature-1 rows with SCHEMA beside two greedy rows without a format, in
    one batch; checks that the greedy rows' tokens equal theirs alone and that the JSON
    validates; returns the JSON texts. `overlap`: the CUDA schedule (step t collected after
    step t+1 is launched: a constrained row's tokens reach its grammar before its next mask)."""
    engine = Engine(model, tokenizer, max_batch=4, max_seq_len=512)
    engine.overlap = overlap
    greedy = SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=())
    alone = [engine.sequence(prompt, greedy) for prompt in ("The cat", "A dog ran")]
    run(engine, alone)
    params = SamplingParams(max_new_tokens=300, temperature=1.0, json_format=JsonFormat.of(SCHEMA))
    beside = [engine.sequence(prompt, greedy) for prompt in ("The cat", "A dog ran")]
    constrained = [engine.sequence(CHAT, params, seed=seed) for seed in (1, 2)]
    run(engine, [constrained[0], beside[0], constrained[1], beside[1]])
    assert [s.token_ids for s in beside] == [s.token_ids for s in alone]
    for sequence in constrained:
        assert sequence.finish_reason == "stop" and sequence.stop in tokenizer.stop_ids
        jsonschema.validate(json.loads(sequence.text), SCHEMA)
        assert all(token < tokenizer.vocab_size for token in sequence.token_ids)
    return [sequence.text for sequence in constrained]


def test_constrained_rows_follow_their_schema_and_leave_the_others_as_alone(model, tokenizer):
    texts = constrained_beside_greedy(model, tokenizer, overlap=False)
    assert constrained_beside_greedy(model, tokenizer, overlap=True) == texts
    engine = Engine(model, tokenizer, max_batch=1, max_seq_len=512)
    unconstrained = engine.sequence(CHAT, SamplingParams(max_new_tokens=60), seed=1)
    run(engine, [unconstrained])
    with pytest.raises(ValueError):  # the random model's own text
        json.loads(unconstrained.text)


def test_json_without_stop_ids_ends_with_its_last_token(model, tokenizer):
    engine = Engine(model, tokenizer, max_batch=2, max_seq_len=512)
    params = SamplingParams(
        max_new_tokens=50, temperature=0, stop_token_ids=(), json_format=JsonFormat()
    )
    sequence = engine.sequence(CHAT, params)
    run(engine, [sequence])
    assert sequence.finish_reason == "stop" and sequence.stop is None
    assert isinstance(json.loads(sequence.text), dict)
    assert tokenizer.decode(sequence.token_ids) == sequence.text  # no stop token at the end


def test_a_length_limit_mid_json_keeps_the_partial_text(model, tokenizer):
    engine = Engine(model, tokenizer, max_batch=1, max_seq_len=512)
    params = SamplingParams(max_new_tokens=6, temperature=0, json_format=JsonFormat.of(SCHEMA))
    sequence = engine.sequence(CHAT, params)
    run(engine, [sequence])
    assert sequence.finish_reason == "length" and len(sequence.token_ids) == 6
    assert sequence.text and '{"name": "'.startswith(sequence.text)  # cut by the limit


def test_errors_name_the_schema_problem_and_the_missing_package(monkeypatch):
    with pytest.raises(ConfigError, match=r"^the JSON schema cannot be followed: Unsupported type"):
        check_json_format(JsonFormat('{"type": "objekt"}'))
    with pytest.raises(ConfigError, match="Cannot find field"):
        check_json_format(JsonFormat.of({"properties": {"a": {"$ref": "#/$defs/missing"}}}))
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(min_tokens=2, json_format=JsonFormat())
    check_json_format(JsonFormat.of(SCHEMA))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'lmforge\[serve\]'"):
        check_json_format(JsonFormat())


def test_compiled_grammars_are_kept_least_recently_used_first_out(tokenizer, monkeypatch):
    monkeypatch.setattr(grammar_module, "GRAMMAR_CACHE_SIZE", 2)
    grammars = Grammars(tokenizer, 384)
    first, second, third = (JsonFormat.of({"enum": [word]}) for word in ("a", "b", "c"))
    compiled = grammars.compiled(first)
    grammars.compiled(second)
    assert grammars.compiled(first) is compiled  # used again: second is now the oldest
    grammars.compiled(third)
    assert list(grammars._compiled) == [first, third]
    with pytest.raises(ConfigError, match="cannot be followed"):
        grammars.compiled(JsonFormat('{"type": "objekt"}'))


def test_a_compiling_grammar_holds_its_request_back_and_the_others_keep_stepping(
    model, tokenizer, monkeypatch
):
    """The server's engine loop (`ready_ops`): a request whose schema is new waits while its
    grammar compiles on the grammar threads (a "grammar" op goes ahead, for the other
    processes under tensor parallelism), the running sequence keeps getting tokens, and the
    request joins once compiled; a cancel of a held request drops it."""
    import threading

    from lmforge.serve.engine import apply_ops, ready_ops

    gate = threading.Event()
    compile_grammar = Grammars._compile

    def gated(self, json_format):
        assert gate.wait(timeout=30)
        return compile_grammar(self, json_format)

    monkeypatch.setattr(Grammars, "_compile", gated)
    engine = Engine(model, tokenizer, max_batch=2, max_seq_len=512)
    ids = engine.encode_prompt(CHAT)
    sequences = {}
    apply_ops(
        engine, [("add", 0, ids, SamplingParams(max_new_tokens=40), 1, None, None)], sequences
    )
    json_params = SamplingParams(
        max_new_tokens=300, temperature=1.0, json_format=JsonFormat.of(SCHEMA)
    )
    add = ("add", 1, ids, json_params, 3, None, None)
    now, held = ready_ops(engine, [], [add])
    assert now == [("grammar", json_params.json_format)] and held == [add]
    for _ in range(3):  # the plain sequence steps on; the held one stays held
        tokens = apply_ops(engine, now, sequences)
        assert [t[0] for t in tokens] == [0]
        now, held = ready_ops(engine, held, [])
        assert now == [] and held == [add]
    cancelled = ("add", 2, ids, json_params, None, None, None)
    assert ready_ops(engine, held, [cancelled, ("cancel", 2)]) == ([("cancel", 2)], [add])
    gate.set()
    engine.grammars().prepare(json_params.json_format).result(timeout=30)
    now, held = ready_ops(engine, held, [])
    assert now == [add] and held == []
    texts = []
    while now or engine.has_work:
        texts += [t[2] for t in apply_ops(engine, now, sequences) if t[0] == 1]
        now = []
    jsonschema.validate(json.loads("".join(texts)), SCHEMA)
