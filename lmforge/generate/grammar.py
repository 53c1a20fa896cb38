"""Structured output: decoding constrained so that a sequence's text is JSON, any object or one
that a JSON schema allows (OpenAI's `response_format`), or JSON values inside fixed text (tool
calls in a model's format, e.g. `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`:
`TaggedJson`), with xgrammar (Dong et al. 2024, https://arxiv.org/abs/2411.15100).

`JsonFormat` is what a sequence asks for (`SamplingParams.json_format`); `check_json_format`
refuses a schema xgrammar cannot follow, before anything is queued (the server's 400).
`Grammars` is one engine's compiler over its tokenizer's vocabulary (`Tokenizer.token_bytes`,
the model's extra ids never allowed), with the grammars it compiled last; it compiles on
threads of its own (`prepare`: xgrammar releases the GIL), so that the server's engine loop
keeps stepping while a new schema compiles (a schema of 40 nested properties took 38 ms over
a 50k vocabulary on this CPU, and grows with both). Each constrained
`Sequence` holds a matcher of its own, which the engine asks for the tokens allowed next and
tells the token chosen (`Engine._grammar_masks`, `Engine._feed_grammars`). xgrammar is imported
only when a format is used: lmforge runs without it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lmforge.errors import ConfigError

INSTALL_HINT = "pip install 'lmforge[serve]'"  # (the serve extra brings xgrammar)
# Compiled grammars an engine keeps, the least recently used dropped first (xgrammar's own
# cache, off here, grows without bound by default). A grammar over a 50k vocabulary took
# 1 MB for a schema of 30 properties.
GRAMMAR_CACHE_SIZE = 64
# `json_object`'s schema: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# How schemas compile: JSON laid out as Python's json.dumps does (", " and ": ", no newlines),
# and no properties or items beyond those a schema lists (xgrammar's strict mode). With any
# whitespace between JSON tokens allowed (xgrammar's default, vLLM's), greedy decoding can
# write whitespace for ever: the tiny test models did after their third key, and vLLM has
# `disable_any_whitespace` for models that do.
JSON_OPTIONS = {"any_whitespace": False}


@dataclass(frozen=True)
class TaggedJson:
    """Fixed text `begin`, a JSON value that the JSON schema `schema` (its JSON text) allows,
    fixed text `end`: one tool call, e.g. begin `<tool_call>\n{"name": "f", "arguments": `, the
    arguments, end `}\n</tool_call>`."""

    begin: str
    schema: str
    end: str


@dataclass(frozen=True)
class JsonFormat:
    """The text a sequence must write: one JSON value that the JSON schema `schema` (its JSON
    text) allows; None: any JSON object (OpenAI's `json_object`). With `tagged`, instead one or
    more of those (any of them each time), `separator` between them; only one where `single`.
    Hashable: the cache key of its compiled grammar."""

    schema: str | None = None
    tagged: tuple[TaggedJson, ...] = ()
    separator: str = ""
    single: bool = False

    @property
    def schema_text(self) -> str:
        return JSON_OBJECT_SCHEMA if self.schema is None else self.schema

    @classmethod
    def of(cls, schema: dict) -> JsonFormat:
        return cls(json.dumps(schema, ensure_ascii=False))


def import_xgrammar():
    """The xgrammar module, or a ConfigError that says how to install it."""
    try:
        import xgrammar
    except ImportError as error:
        raise ConfigError(
            f"structured output (a JSON response format) needs xgrammar ({error}); install it "
            f"with `{INSTALL_HINT}`"
        ) from None
    return xgrammar


def check_json_format(json_format: JsonFormat) -> None:
    """Raise a ConfigError with xgrammar's reason where the schema is not one it can follow
    (not JSON, an unsupported type, a `$ref` to nothing, ...), or where xgrammar is missing.
    Tokenizer-free: the server's HTTP side checks what the engine will compile."""
    grammar = import_xgrammar().Grammar
    _followed(json_format, grammar.from_json_schema, grammar.from_structural_tag)


def _followed(json_format: JsonFormat, compile_schema, compile_structural_tag):
    """json_format's grammar: compile_schema(its schema, JSON_OPTIONS), or where it is tagged
    compile_structural_tag(its structural tag); a ConfigError with xgrammar's reason where it
    cannot be followed."""
    try:
        if json_format.tagged:
            return compile_structural_tag(_structural_tag(json_format))
        return compile_schema(json_format.schema_text, **JSON_OPTIONS)
    except (RuntimeError, ValueError, TypeError) as error:  # its C++ checks raise RuntimeError
        raise ConfigError(f"the JSON schema cannot be followed: {_reason(error)}") from None


def _structural_tag(json_format: JsonFormat) -> str:
    """xgrammar's structural tag (its JSON text) of a tagged format. Each value goes in as the
    grammar of its schema compiled with JSON_OPTIONS: the tag's own JSON content allows any
    whitespace, which a random or weak model writes for ever (see JSON_OPTIONS)."""
    from_schema = import_xgrammar().Grammar.from_json_schema
    tags = [
        {
            "type": "tag",
            "begin": tagged.begin,
            "content": {
                "type": "grammar",
                "grammar": str(from_schema(tagged.schema, **JSON_OPTIONS)),
            },
            "end": tagged.end,
        }
        for tagged in json_format.tagged
    ]
    tags_format = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": json_format.separator,
        "at_least_one": True,
        "stop_after_first": json_format.single,
    }
    return json.dumps({"type": "structural_tag", "format": tags_format})


def _reason(error: Exception) -> str:
    """xgrammar's message without the "[time] file.cc:line: " of its C++ checks."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())


class Grammars:
    """One engine's grammar compiler and its least recently used compiled grammars.

    Args:
        tokenizer: the engine's (`lmforge.data.tokenizer.Tokenizer`).
        vocab_size: the model's; ids past the tokenizer's are never allowed.
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        xgrammar = import_xgrammar()
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo(
            tokenizer.token_bytes()[:vocab_size],  # b"" entries: special, never allowed
            xgrammar.VocabType.RAW,  # the bytes themselves, decoded above
            vocab_size=vocab_size,
            stop_token_ids=sorted(i for i in tokenizer.stop_ids if i < vocab_size),
        )
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self._compiled: OrderedDict[JsonFormat, object] = OrderedDict()
        self._compiling: dict[JsonFormat, Future] = {}
        self._lock = threading.Lock()  # the two dicts: the engine's thread and the compiles'
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmforge-grammar")
        # fills a step's masks on threads of its own (the GIL released); one matcher after
        # another on the engine's thread, half of 32 streams constrained ran at 40% of the
        # plain tokens/s (1B, H100, 2026-12-07; not measured since)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads="auto")

    def prepare(self, json_format: JsonFormat) -> Future:
        """`json_format`'s xgrammar.CompiledGrammar as a future: done where it was compiled
        already, else compiling on a thread of this object's (its exception a ConfigError
        where it cannot be)."""
        with self._lock:
            if json_format in self._compiled:
                self._compiled.move_to_end(json_format)
                future = Future()
                future.set_result(self._compiled[json_format])
                return future
            future = self._compiling.get(json_format)
            if future is None:
                future = self._pool.submit(self._compile, json_format)
                self._compiling[json_format] = future
            return future

    def _compile(self, json_format: JsonFormat):
        compiler = self._compiler
        try:
            grammar = _followed(
                json_format, compiler.compile_json_schema, compiler.compile_structural_tag
            )
        except BaseException:
            with self._lock:
                del self._compiling[json_format]  # the next ask tries again
            raise
        with self._lock:
            self._compiled[json_format] = grammar
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
            del self._compiling[json_format]
        return grammar

    def compiled(self, json_format: JsonFormat):
        """`json_format`'s xgrammar.CompiledGrammar, waiting for its compile (a ConfigError
        where it cannot be)."""
        return self.prepare(json_format).result()

    def matcher(self, json_format: JsonFormat, stop_ids: frozenset[int]):
        """A new xgrammar.GrammarMatcher of `json_format` for a sequence ending at `stop_ids`:
        once the JSON is complete it allows those alone. Without stop ids it terminates with
        the JSON's last token."""
        xgrammar = import_xgrammar()
        stops = sorted(i for i in stop_ids if i < self.vocab_size)
        return xgrammar.GrammarMatcher(
            self.compiled(json_format),
            override_stop_tokens=stops or None,
            terminate_without_stop_token=not stops,
        )

    def masks(self, matchers: list) -> torch.Tensor:
        """The tokens each matcher allows next: a bitmask [len(matchers), ceil(vocab / 32)]
        int32 on the host, bit j of word w set where token 32w + j is allowed."""
        xgrammar = import_xgrammar()
        bitmask = xgrammar.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask
