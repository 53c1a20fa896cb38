"""Tokenizers: one `Tokenizer` interface over the formats a Llama artifact can carry.

Two backends read what is on disk: a Hugging Face `tokenizer.json` (through the `tokenizers`
library, with `tokenizer_config.json` for the chat template and the BOS/EOS names) and Meta's
tiktoken-format `original/tokenizer.model` (base64 token + rank per line, through `tiktoken`,
with Llama 3's split regex and its 256 special tokens appended after the ranks). `train_bpe`
trains a new byte-level BPE with the Llama 3 split regex and special tokens and saves it so that
transformers loads it unchanged. `encode` never turns special-token text found in the input into
special ids (a document containing "<|eot_id|>" cannot end a turn); only `encode_chat`, which
encodes a rendered chat template, parses them. `fingerprint()` hashes the vocabulary, merges and
special tokens in a backend-independent form, so the tiktoken file and the `tokenizer.json` of the
same Llama 3 tokenizer get the same fingerprint and data shards made with either are accepted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import tiktoken
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers

from lmforge.errors import ConfigError, DataError, ModelFormatError

# The pre-tokenization regex of Llama 3 (and its tiktoken file): contractions, words with one
# optional leading non-letter, numbers of at most 3 digits, punctuation runs, newlines, spaces.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"
PAD = "<|finetune_right_pad_id|>"

_NUM_LLAMA3_SPECIAL_TOKENS = 256
_LLAMA3_NAMED_SPECIAL_TOKENS = (
    BEGIN_OF_TEXT,
    END_OF_TEXT,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    PAD,
    "<|step_id|>",
    START_HEADER,
    END_HEADER,
    EOM,
    EOT,
    "<|python_tag|>",
)
# The 256 special tokens Llama 3.1+ appends after the 128,000 ranks, in id order.
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = _LLAMA3_NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{i}|>"
    for i in range(2, 2 + _NUM_LLAMA3_SPECIAL_TOKENS - len(_LLAMA3_NAMED_SPECIAL_TOKENS))
)
# The subset `train_bpe` adds to a new tokenizer: enough for pretraining and the chat format.
TRAIN_SPECIAL_TOKENS: tuple[str, ...] = (
    BEGIN_OF_TEXT,
    END_OF_TEXT,
    START_HEADER,
    END_HEADER,
    EOT,
    PAD,
)

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "ipython", "tool")

# The Llama 3 chat format as a jinja template (the form transformers and vLLM read from
# tokenizer_config.json). `render_llama3_chat` is the same format in Python; a test keeps the two
# identical. Every tag strips the whitespace around it, so the layout here never reaches the output.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message['role'] not in ['system', 'user', 'assistant', 'ipython', 'tool'] -%}\n"
    "    {{- raise_exception('unknown chat role ' ~ message['role'] ~ "
    "' in message ' ~ loop.index0 ~ '; allowed: system, user, assistant, ipython, tool') -}}\n"
    "  {%- endif -%}\n"
    "  {%- if message['content'] is string -%}\n"
    "    {%- set content = message['content'] -%}\n"
    "  {%- elif message['content'] is not defined or message['content'] is none -%}\n"
    "    {%- set content = '' -%}\n"
    "  {%- else -%}\n"
    "    {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}\n"
    "  {%- endif -%}\n"
    "  {{- '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\\n\\n'"
    " ~ (content | trim) ~ '<|eot_id|>' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "{%- endif -%}\n"
)

# transformers' default when a config has no model_max_length is "unlimited"; Llama 3.1's
# context length is a more useful number to write.
DEFAULT_MODEL_MAX_LENGTH = 131072

# tiktoken's regex engine recurses on very long runs of spaces or of non-spaces; cut them into
# pieces of at most this many characters before encoding (as Meta's reference code does).
_MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{_MAX_RUN_CHARS + 1},}}|(?<!\s)\s{{{_MAX_RUN_CHARS + 1},}}")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to chr(256 + n) in order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    num_shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + num_shifted)
            num_shifted += 1
    return mapping


_BYTE_TO_UNICODE = _byte_to_unicode()
_UNICODE_TO_BYTE = {char: b for b, char in _BYTE_TO_UNICODE.items()}


def _bytes_to_bytelevel(token: bytes) -> str:
    return "".join(_BYTE_TO_UNICODE[b] for b in token)


def _bytelevel_to_bytes(token: str) -> bytes | None:
    """The bytes a byte-level vocabulary entry stands for, or None if it is not byte-level."""
    try:
        return bytes(_UNICODE_TO_BYTE[char] for char in token)
    except KeyError:
        return None


# ----------------------------------------------------------------------------------------------
# Chat format


def _message_content(message: Any, index: int) -> tuple[str, str]:
    """(role, text) of one chat message, or a DataError naming what is wrong with it."""
    if not isinstance(message, Mapping):
        raise DataError(
            f"chat message {index} is a {type(message).__name__}; "
            "expected a dict with 'role' and 'content'"
        )
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise DataError(
            f"unknown chat role {role!r} in message {index}; allowed: {', '.join(CHAT_ROLES)}"
        )
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise DataError(
                    f"chat message {index} has a content part that is not "
                    f"{{'type': 'text', 'text': ...}}: {part!r:.80}"
                )
            texts.append(str(part.get("text", "")))
        return role, "".join(texts)
    raise DataError(
        f"chat message {index} has content of type {type(content).__name__}; "
        "expected a string or a list of text parts"
    )


def render_llama3_chat(
    messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False
) -> str:
    """Render messages in the Llama 3 chat format (the same string as LLAMA3_CHAT_TEMPLATE).

    `<|begin_of_text|>`, then per message
    `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content stripped}<|eot_id|>`, then with
    `add_generation_prompt` the header that opens the assistant's turn.
    """
    parts = [BEGIN_OF_TEXT]
    for index, message in enumerate(messages):
        role, content = _message_content(message, index)
        parts.append(f"{START_HEADER}{role}{END_HEADER}\n\n{content.strip()}{EOT}")
    if add_generation_prompt:
        parts.append(f"{START_HEADER}assistant{END_HEADER}\n\n")
    return "".join(parts)


class _TemplateRaised(jinja2.TemplateError):
    """What `raise_exception(...)` in a chat template raises."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False):
    # Unlike jinja's own `tojson`, do not HTML-escape: chat templates produce prompts, not HTML.
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some templates to mark assistant
    tokens): rendered as its body."""

    tags = {"generation"}  # noqa: RUF012  (jinja's Extension API declares it this way)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller):
        return caller()


def _chat_template_env() -> jinja2.Environment:
    # The same environment settings as transformers, so templates render identically there.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile_chat_template(source: str) -> jinja2.Template:
    return _chat_template_env().from_string(source)


@lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str]:
    try:
        parsed = _chat_template_env().parse(source)
    except jinja2.TemplateError:
        return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))


# ----------------------------------------------------------------------------------------------
# The interface


class Tokenizer:
    """One interface over several tokenizer formats; build one with `load_tokenizer`.

    Attributes:
        vocab_size: total number of ids including special tokens (max id + 1).
        bos_id, eos_id, eot_id, pad_id: ids of those tokens, None when the tokenizer has none.
        stop_ids: ids that end generation (eos, `<|eot_id|>`, `<|eom_id|>`, generation_config's).
        special_tokens: special token text -> id.
        chat_template: jinja source of the chat template, or None.
        backend: "huggingface" or "tiktoken".
        source: the file or directory it was loaded from (None for one built in memory).
    """

    backend: str = ""
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    pad_id: int | None
    stop_ids: set[int]
    special_tokens: dict[str, int]
    chat_template: str | None

    def _init_common(
        self,
        *,
        vocab_size: int,
        special_tokens: dict[str, int],
        config: Mapping[str, Any] | None,
        chat_template: str | None,
        extra_stop_ids: Iterable[int],
        source: Path | None,
    ) -> None:
        """What every format shares: vocabulary size, special tokens and their roles, the
        tokenizer config and chat template (from the config when not given)."""
        config = dict(config or {})
        if chat_template is None:
            chat_template = _config_chat_template(config)
        self.vocab_size = vocab_size
        self.special_tokens = special_tokens
        self.source = source
        self._config = config
        self._compiled_template: jinja2.Template | None = None
        self._fingerprint: str | None = None

        def name(key: str, *defaults: str) -> str | None:
            value = _token_text(config.get(key))
            if value is not None:
                return value
            return next((d for d in defaults if self.token_to_id(d) is not None), None)

        self.bos_token = name("bos_token", BEGIN_OF_TEXT, "<s>")
        self.eos_token = name("eos_token", END_OF_TEXT, "</s>")
        self.pad_token = name("pad_token", PAD)
        self.bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_id = self.token_to_id(self.pad_token) if self.pad_token else None
        self.eot_id = self.token_to_id(EOT)
        stop = {self.eos_id, self.eot_id, self.token_to_id(EOM), *extra_stop_ids}
        self.stop_ids = {i for i in stop if i is not None}
        if chat_template is None and self.token_to_id(START_HEADER) is not None:
            # A Llama 3 vocabulary without a template (base models, a bare tokenizer.model).
            chat_template = LLAMA3_CHAT_TEMPLATE
        self.chat_template = chat_template

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(source={str(self.source)!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, eot_id={self.eot_id})"
        )

    # --- per backend -------------------------------------------------------------------------

    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def _encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._encode_plain(text) for text in texts]

    def _encode_with_specials(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; incomplete UTF-8 sequences become U+FFFD."""
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry or special token given as text, or None."""
        raise NotImplementedError

    def text_stream(self) -> Callable[[int], str | None] | None:
        """An incremental decoder of generated ids, if the backend has one: each call takes
        the next id and returns the text that became complete with it (None while a UTF-8
        character is incomplete). None: use `decode` over a window (IncrementalText does)."""
        return None

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for, in id order (`vocab_size` entries): what a grammar
        matches generated text against (lmforge/generate/grammar.py). Special tokens, and ids
        the vocabulary skips, are b"" (never text)."""
        raise NotImplementedError

    @property
    def num_merges(self) -> int:
        """Number of BPE merges (for reports)."""
        raise NotImplementedError

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to `directory`,
        readable by `load_tokenizer` and by `transformers.AutoTokenizer.from_pretrained`."""
        raise NotImplementedError

    def _fingerprint_parts(self) -> Iterator[str]:
        raise NotImplementedError

    # --- shared ------------------------------------------------------------------------------

    @property
    def adds_bos(self) -> bool:
        """Whether transformers' tokenizer for these files starts an encoded text with BOS
        (`add_special_tokens=True`, its default): what lm-eval's `hf` backend gets."""
        return False

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text`. Special-token text inside `text` is encoded as ordinary text."""
        return self._add_bos_eos(self._encode_plain(text), bos=bos, eos=eos)

    def encode_batch(
        self, texts: Iterable[str], *, bos: bool = False, eos: bool = False
    ) -> list[list[int]]:
        """`encode` for many texts at once (parallel where the backend allows)."""
        return [
            self._add_bos_eos(ids, bos=bos, eos=eos)
            for ids in self._encode_plain_batch(list(texts))
        ]

    def _add_bos_eos(self, ids: list[int], *, bos: bool, eos: bool) -> list[int]:
        if bos:
            if self.bos_id is None:
                raise ModelFormatError(f"tokenizer {self.source} has no BOS token")
            ids.insert(0, self.bos_id)
        if eos:
            if self.eos_id is None:
                raise ModelFormatError(f"tokenizer {self.source} has no EOS token")
            ids.append(self.eos_id)
        return ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **template_vars: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template.

        `template_vars` (e.g. `tools=[...]`, `date_string=...`) are passed to the template.
        """
        if self.chat_template is None:
            raise ModelFormatError(f"tokenizer {self.source} has no chat template")
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise DataError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
        if self._compiled_template is None:
            try:
                self._compiled_template = _compile_chat_template(self.chat_template)
            except jinja2.TemplateError as err:
                raise ModelFormatError(
                    f"chat template of {self.source} does not parse: {err}"
                ) from None
        special_names = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token,
            "unk_token": _token_text(self._config.get("unk_token")),
        }
        context = {"tools": None, "documents": None, **special_names, **template_vars}
        try:
            return self._compiled_template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **context
            )
        except _TemplateRaised as err:
            raise DataError(f"chat template refused the messages: {err}") from None
        except jinja2.TemplateError as err:
            raise DataError(f"chat template failed on the messages: {err}") from None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the server's HTTP process gets a copy): the compiled template is not,
        and is compiled again on first use."""
        return {**self.__dict__, "_compiled_template": None}

    def use_chat_template(self, template: str) -> None:
        """Replace the chat template (jinja text); raises ConfigError when it does not parse."""
        try:
            compiled = _compile_chat_template(template)
        except jinja2.TemplateError as err:
            raise ConfigError(f"the chat template does not parse: {err}") from None
        self.chat_template, self._compiled_template = template, compiled

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        **template_vars: Any,
    ) -> list[int]:
        """Ids of the rendered chat, with its special-token text parsed as special tokens.

        The template writes BOS itself, so none is added here. `template_vars` (e.g.
        `tools=[...]`) are passed to the template.
        """
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_vars
        )
        return self._encode_with_specials(text)

    def chat_template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (jinja's own analysis), e.g.
        "tools" where it renders a tool list itself; empty without a template or where it does
        not parse."""
        return (
            frozenset() if self.chat_template is None else _template_variables(self.chat_template)
        )

    def fingerprint(self) -> str:
        """sha256 hex of vocabulary, merges and special tokens, the same for every backend."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for part in self._fingerprint_parts():
                digest.update(part.encode())
                digest.update(b"\n")
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def _config_for_save(self) -> dict[str, Any]:
        config = {k: v for k, v in self._config.items() if k != "chat_template"}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config.setdefault("model_max_length", DEFAULT_MODEL_MAX_LENGTH)
        config.setdefault("model_input_names", ["input_ids", "attention_mask"])
        # transformers' default would change decoded text ("a ." -> "a."); ours never does.
        config["clean_up_tokenization_spaces"] = False
        for key, token in (
            ("bos_token", self.bos_token),
            ("eos_token", self.eos_token),
            ("pad_token", self.pad_token),
        ):
            if token is not None:
                config[key] = token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return config

    def _write_configs(self, directory: Path) -> None:
        config = self._config_for_save()
        _write_json(directory / "tokenizer_config.json", config)
        special_map = {
            key: config[key] for key in ("bos_token", "eos_token", "pad_token") if key in config
        }
        _write_json(directory / "special_tokens_map.json", special_map)
        template_file = directory / "chat_template.jinja"
        if self.chat_template is not None:
            # Newer transformers read this file first; keep it in step with the config.
            template_file.write_text(self.chat_template, encoding="utf-8")
        elif template_file.exists():
            template_file.unlink()


def _token_text(value: Any) -> str | None:
    """A special token's text from a config value: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _as_id_list(ids: Iterable[int]) -> list[int]:
    tolist = getattr(ids, "tolist", None)  # numpy arrays and torch tensors
    return [int(i) for i in (tolist() if tolist is not None else ids)]


def _merge_triples(pairs: Iterable[tuple[int, int, int]]) -> Iterator[str]:
    """Merges as sorted "result left right" id triples: a form both backends can produce."""
    yield "merges"
    for result, left, right in sorted(pairs):
        yield f"{result} {left} {right}"


# ----------------------------------------------------------------------------------------------
# Backend (a): Hugging Face tokenizer.json


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` read with the `tokenizers` library."""

    backend = "huggingface"

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
        source: Path | None = None,
    ) -> None:
        # Two copies: `_plain` encodes special-token text as text (set below), `_parsing`
        # (made on first use) recognizes it, for rendered chat templates.
        self._plain = hf
        self._plain.encode_special_tokens = True
        self._parsing: tokenizers.Tokenizer | None = None
        added = hf.get_added_tokens_decoder()
        special_tokens = {tok.content: i for i, tok in sorted(added.items()) if tok.special}
        vocab_size = max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._init_common(
            vocab_size=vocab_size,
            special_tokens=special_tokens,
            config=config,
            chat_template=chat_template,
            extra_stop_ids=extra_stop_ids,
            source=source,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plain.encode_special_tokens = True  # a pickled `tokenizers.Tokenizer` loses it

    @property
    def num_merges(self) -> int:
        return len(json.loads(self._plain.to_str())["model"].get("merges") or [])

    def _encode_plain(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def adds_bos(self) -> bool:
        if self.bos_id is None:
            return False
        with_specials = self._plain.encode("a", add_special_tokens=True).ids
        return with_specials[:1] == [self.bos_id] and self._encode_plain("a")[:1] != [self.bos_id]

    def _encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._plain.encode_batch(texts, add_special_tokens=False)]

    def _encode_with_specials(self, text: str) -> list[int]:
        if self._parsing is None:
            # to_str() does not carry the encode_special_tokens switch: this copy parses them.
            self._parsing = tokenizers.Tokenizer.from_str(self._plain.to_str())
        return self._parsing.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return self._plain.decode(_as_id_list(ids), skip_special_tokens=skip_special)

    def text_stream(self) -> Callable[[int], str | None] | None:
        decode_stream = getattr(tokenizers.decoders, "DecodeStream", None)  # tokenizers >= 0.21
        if decode_stream is None:
            return None
        stream = decode_stream(skip_special_tokens=False)
        return partial(stream.step, self._plain)

    def token_to_id(self, token: str) -> int | None:
        return self._plain.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        data = json.loads(self._plain.to_str())
        byte_level = _is_byte_level(data)
        entries = [b""] * self.vocab_size
        for token, i in self._plain.get_vocab(with_added_tokens=False).items():
            raw = _bytelevel_to_bytes(token) if byte_level else _sentencepiece_bytes(token)
            entries[i] = token.encode() if raw is None else raw
        for i, added in self._plain.get_added_tokens_decoder().items():
            entries[i] = b"" if added.special else added.content.encode()
        return entries

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._plain.save(str(directory / "tokenizer.json"))
        self._write_configs(directory)

    def _fingerprint_parts(self) -> Iterator[str]:
        data = json.loads(self._plain.to_str())
        model = data.get("model") or {}
        added = sorted(
            (t["id"], t["content"], bool(t.get("special"))) for t in data["added_tokens"]
        )
        yield "lmforge-tokenizer-fingerprint-v1"
        if model.get("type") == "BPE":
            vocab: dict[str, int] = model["vocab"]
            token_bytes = {token: _bytelevel_to_bytes(token) for token in vocab}
            byte_level = _is_byte_level(data) and None not in token_bytes.values()
            yield "vocab " + ("bytes" if byte_level else "text")
            for token, i in sorted(vocab.items(), key=lambda item: item[1]):
                raw = token_bytes[token] if byte_level else token.encode()
                yield f"{i} {raw.hex()}"
            merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"] or []]
            yield from _merge_triples(
                (vocab.get(left + right, -1), vocab.get(left, -1), vocab.get(right, -1))
                for left, right in merges
            )
        else:
            yield "model " + json.dumps(model, sort_keys=True, ensure_ascii=False)
        yield "added"
        for i, content, special in added:
            yield f"{i} {content.encode().hex()} {int(special)}"


_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece_bytes(token: str) -> bytes:
    """The bytes of a SentencePiece-style vocabulary entry: "▁" is a space, "<0x0A>" a byte."""
    found = _BYTE_FALLBACK_TOKEN.fullmatch(token)
    if found:
        return bytes([int(found.group(1), 16)])
    return token.replace("\u2581", " ").encode()


def _is_byte_level(data: dict[str, Any]) -> bool:
    decoder = data.get("decoder") or {}
    parts = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    return any((part or {}).get("type") == "ByteLevel" for part in parts or [])


def _config_chat_template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


# ----------------------------------------------------------------------------------------------
# Backend (b): Meta's tiktoken-format tokenizer.model


class TiktokenTokenizer(Tokenizer):
    """Llama 3's `tokenizer.model` (base64 token + rank per line) read with `tiktoken`."""

    backend = "tiktoken"

    def __init__(
        self,
        ranks: dict[bytes, int],
        *,
        pattern: str = LLAMA3_SPLIT_PATTERN,
        special_token_names: Sequence[str] = LLAMA3_SPECIAL_TOKENS,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
        source: Path | None = None,
    ) -> None:
        self._ranks = ranks
        self._pattern = pattern
        num_base = len(ranks)
        special_tokens = {name: num_base + i for i, name in enumerate(special_token_names)}
        self._special_ids = frozenset(special_tokens.values())
        self._enc = tiktoken.Encoding(
            name=f"lmforge:{source}",
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens=special_tokens,
        )
        self._init_common(
            vocab_size=num_base + len(special_tokens),
            special_tokens=special_tokens,
            config=config,
            chat_template=chat_template,
            extra_stop_ids=extra_stop_ids,
            source=source,
        )

    @property
    def num_merges(self) -> int:
        """Number of merge steps: every token longer than one byte is made by one."""
        return sum(1 for token in self._ranks if len(token) > 1)

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _cut_long_runs(text):
            ids.extend(self._enc.encode_ordinary(piece))
        return ids

    def _encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        if any(len(text) > _MAX_RUN_CHARS for text in texts):
            return [self._encode_plain(text) for text in texts]
        return self._enc.encode_ordinary_batch(texts)

    @property
    def adds_bos(self) -> bool:
        return self.bos_id is not None  # as transformers' Llama 3 conversion and `to_hf`

    def _encode_with_specials(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _cut_long_runs(text):
            ids.extend(self._enc.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        id_list = _as_id_list(ids)
        if skip_special:
            id_list = [i for i in id_list if i not in self._special_ids]
        bad = [i for i in id_list if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        return self._enc.decode(id_list, errors="replace")

    def token_to_id(self, token: str) -> int | None:
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._ranks.get(token.encode())

    def token_bytes(self) -> list[bytes]:
        entries = [b""] * self.vocab_size  # the special tokens' ids follow the ranks
        for token, rank in self._ranks.items():
            entries[rank] = token
        return entries

    def save(self, directory: str | Path) -> None:
        """Write `original/tokenizer.model` plus an equivalent tokenizer.json and configs."""
        directory = Path(directory)
        (directory / "original").mkdir(parents=True, exist_ok=True)
        lines = (
            f"{base64.b64encode(token).decode()} {rank}\n"
            for token, rank in sorted(self._ranks.items(), key=lambda item: item[1])
        )
        (directory / "original" / "tokenizer.model").write_text("".join(lines), encoding="ascii")
        self.to_hf().save(str(directory / "tokenizer.json"))
        self._write_configs(directory)

    def _merges(self) -> list[tuple[int, int, int]]:
        """(result, left, right) rank triples: every split of a token into two tokens.

        tiktoken has no merge list; it merges the adjacent pair whose concatenation has the
        lowest rank. Listing every two-token split ordered by the result's rank gives a BPE
        merge list that encodes the same way (the conversion transformers also uses).
        """
        triples = []
        for token, rank in self._ranks.items():
            for cut in range(1, len(token)):
                left = self._ranks.get(token[:cut])
                right = self._ranks.get(token[cut:])
                if left is not None and right is not None:
                    triples.append((rank, left, right))
        triples.sort()
        return triples

    def to_hf(self) -> tokenizers.Tokenizer:
        """The same tokenizer as a `tokenizers.Tokenizer` (what save() writes as tokenizer.json)."""
        by_rank = {rank: token for token, rank in self._ranks.items()}
        vocab = {_bytes_to_bytelevel(token): rank for token, rank in self._ranks.items()}
        merges = [
            (_bytes_to_bytelevel(by_rank[left]), _bytes_to_bytelevel(by_rank[right]))
            for _, left, right in self._merges()
        ]
        # ignore_merges: a pre-token that is itself in the vocabulary is one token, as in tiktoken.
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
        _set_llama3_pipeline(hf, self._pattern)
        names = sorted(self.special_tokens, key=self.special_tokens.__getitem__)
        hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
        for name in names:
            assert hf.token_to_id(name) == self.special_tokens[name], name
        _add_bos_on_encode(hf, self.bos_token)
        return hf

    def _fingerprint_parts(self) -> Iterator[str]:
        yield "lmforge-tokenizer-fingerprint-v1"
        yield "vocab bytes"
        for token, rank in sorted(self._ranks.items(), key=lambda item: item[1]):
            yield f"{rank} {token.hex()}"
        yield from _merge_triples(self._merges())
        yield "added"
        for name, i in sorted(self.special_tokens.items(), key=lambda item: item[1]):
            yield f"{i} {name.encode().hex()} 1"


def _cut_long_runs(text: str) -> list[str]:
    """`text` cut so that no run of spaces or of non-spaces is longer than _MAX_RUN_CHARS."""
    if len(text) <= _MAX_RUN_CHARS:
        return [text]
    pieces, start = [], 0
    for match in _LONG_RUN.finditer(text):
        for cut in range(match.start() + _MAX_RUN_CHARS, match.end(), _MAX_RUN_CHARS):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces


def _add_bos_on_encode(hf: tokenizers.Tokenizer, bos_token: str | None) -> None:
    """Make transformers (and vLLM, lm-eval's `hf` backend) start every encoded text with BOS,
    as Llama 3's own tokenizer.json does and as lmforge's pretraining data begins each
    document. lmforge's own calls encode without special tokens and add BOS where they mean to."""
    bos_id = hf.token_to_id(bos_token) if bos_token else None
    if bos_id is None:
        return
    hf.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos_token} $A",
                pair=f"{bos_token} $A {bos_token}:1 $B:1",
                special_tokens=[(bos_token, bos_id)],
            ),
        ]
    )


def _set_llama3_pipeline(hf: tokenizers.Tokenizer, pattern: str) -> None:
    """Llama 3 split regex, then bytes -> printable characters; no BOS added automatically."""
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ModelFormatError(f"{path}: cannot read tokenizer file: {err.strerror}") from None
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (ValueError, binascii.Error):
            hint = ""
            if not data.isascii() or re.search(rb"[\x00-\x08\x0e-\x1f]", data):
                hint = " (a binary file: a SentencePiece model? only Llama 3's format is read)"
            raise ModelFormatError(
                f"{path}:{line_number}: not a tiktoken BPE file: expected "
                f"'<base64 token> <rank>' per line{hint}"
            ) from None
        if token in ranks:
            raise ModelFormatError(f"{path}:{line_number}: token {token!r} is listed twice")
        ranks[token] = rank
    if not ranks:
        raise ModelFormatError(f"{path}: tokenizer file is empty")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelFormatError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ModelFormatError(
            f"{path}: {len(missing)} of the 256 single-byte tokens are missing "
            f"(first: {missing[0]}); a byte-level BPE needs all of them"
        )
    return ranks


# ----------------------------------------------------------------------------------------------
# Loading


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ModelFormatError(f"{path}: cannot read: {err.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFormatError(f"{path}: not valid JSON: {err}") from None


def _read_side_files(directory: Path) -> tuple[dict[str, Any], str | None, list[int]]:
    """tokenizer_config.json, chat_template.jinja and generation_config.json's stop ids."""
    config: dict[str, Any] = {}
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        config = _read_json(config_file)
        if not isinstance(config, dict):
            raise ModelFormatError(f"{config_file}: expected a JSON object")
    template_file = directory / "chat_template.jinja"
    chat_template = None
    if template_file.is_file():
        chat_template = template_file.read_text(encoding="utf-8")
    stop_ids: list[int] = []
    generation_file = directory / "generation_config.json"
    if generation_file.is_file():
        generation = _read_json(generation_file)
        eos = generation.get("eos_token_id") if isinstance(generation, dict) else None
        stop_ids = [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
    return config, chat_template, stop_ids


def _load_hf(json_file: Path) -> HFTokenizer:
    try:
        hf = tokenizers.Tokenizer.from_file(str(json_file))
    except Exception as err:  # the library raises a bare Exception for every kind of problem
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelFormatError(f"{json_file}: cannot read tokenizer: {first_line}") from None
    config, chat_template, stop_ids = _read_side_files(json_file.parent)
    return HFTokenizer(
        hf,
        config=config,
        chat_template=chat_template,
        extra_stop_ids=stop_ids,
        source=json_file.parent,
    )


def _load_tiktoken(model_file: Path) -> TiktokenTokenizer:
    ranks = _read_tiktoken_ranks(model_file)
    # Meta's layout keeps the file in `original/`; the HF configs sit one level up.
    side_dir = model_file.parent
    if side_dir.name == "original" and (side_dir.parent / "tokenizer_config.json").is_file():
        side_dir = side_dir.parent
    config, chat_template, stop_ids = _read_side_files(side_dir)
    return TiktokenTokenizer(
        ranks,
        config=config,
        chat_template=chat_template,
        extra_stop_ids=stop_ids,
        source=model_file,
    )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a directory or a file.

    Args:
        path: a directory with tokenizer.json (+ tokenizer_config.json), or with
            tokenizer.model or original/tokenizer.model (tiktoken format); or one of those files.

    Raises:
        ModelFormatError: the path is missing, holds no tokenizer, or the file is unreadable.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFormatError(
            f"{path}: no such file or directory (expected a tokenizer directory or file)"
        )
    if path.is_file():
        if path.suffix == ".json":
            return _load_hf(path)
        return _load_tiktoken(path)
    if (path / "tokenizer.json").is_file():
        return _load_hf(path / "tokenizer.json")
    for candidate in (path / "tokenizer.model", path / "original" / "tokenizer.model"):
        if candidate.is_file():
            return _load_tiktoken(candidate)
    raise ModelFormatError(
        f"{path}: no tokenizer found "
        "(looked for tokenizer.json, tokenizer.model, original/tokenizer.model)"
    )


# ----------------------------------------------------------------------------------------------
# Backend (c): training a new byte-level BPE

_TRAIN_CHUNK_CHARS = 1 << 20


def _read_training_text(files: Sequence[Path], num_chars: list[int]) -> Iterator[str]:
    """The files' text in chunks of about 1 MiB that end at a line end; counts characters
    into num_chars[0]. Errors raised here come out of the tokenizers library unchanged."""
    for file in files:
        try:
            with file.open(encoding="utf-8") as handle:
                chunk: list[str] = []
                size = 0
                for line in handle:
                    chunk.append(line)
                    size += len(line)
                    if size >= _TRAIN_CHUNK_CHARS:
                        num_chars[0] += size
                        yield "".join(chunk)
                        chunk, size = [], 0
                if chunk:
                    num_chars[0] += size
                    yield "".join(chunk)
        except UnicodeDecodeError:
            raise DataError(f"{file}: not UTF-8 text") from None
        except OSError as err:
            raise DataError(f"{file}: cannot read: {err.strerror}") from None


def train_bpe(
    files: Sequence[str | Path],
    *,
    vocab_size: int,
    out_dir: str | Path,
    special_tokens: Sequence[str] = TRAIN_SPECIAL_TOKENS,
    min_frequency: int = 2,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> Tokenizer:
    """Train a byte-level BPE (Llama 3 split regex) on UTF-8 text files and save it to `out_dir`.

    Special tokens get the ids after the learned vocabulary, as in Llama 3, and `vocab_size`
    counts them. lmforge's `encode(text)` adds no BOS (`encode(text, bos=True)` does);
    transformers' `encode` adds it, as for Llama 3's own tokenizer. The saved directory loads
    with `load_tokenizer` and with `transformers.AutoTokenizer`.
    BPE: Sennrich et al. 2016, https://arxiv.org/abs/1508.07909.

    Returns:
        the trained tokenizer, loaded back from `out_dir`. Its vocabulary is smaller than
        `vocab_size` when the text has too few distinct pairs to fill it.
    """
    paths = [Path(f).expanduser() for f in files]
    if not paths:
        raise DataError("no input files to train a tokenizer on")
    for path in paths:
        if not path.is_file():
            raise DataError(f"{path}: no such file")
    special_tokens = list(dict.fromkeys(special_tokens))
    min_vocab = 256 + len(special_tokens)
    if vocab_size < min_vocab:
        raise ConfigError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens "
            f"+ {len(special_tokens)} special tokens = {min_vocab} at least"
        )

    hf = tokenizers.Tokenizer(models.BPE())
    _set_llama3_pipeline(hf, LLAMA3_SPLIT_PATTERN)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens),
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],  # added after training so that they get the last ids
        show_progress=sys.stderr.isatty(),
    )
    num_chars = [0]
    hf.train_from_iterator(_read_training_text(paths, num_chars), trainer=trainer)
    if num_chars[0] == 0:
        raise DataError(f"no text in {', '.join(map(str, paths))}")
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])

    def first_present(*names: str) -> str | None:
        return next((n for n in names if n in special_tokens), None)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": first_present(BEGIN_OF_TEXT),
        "eos_token": first_present(END_OF_TEXT, EOT),
        "pad_token": first_present(PAD),
    }
    config = {k: v for k, v in config.items() if v is not None}
    _add_bos_on_encode(hf, config.get("bos_token"))
    chat_template = (
        LLAMA3_CHAT_TEMPLATE if {START_HEADER, END_HEADER, EOT} <= set(special_tokens) else None
    )
    HFTokenizer(hf, config=config, chat_template=chat_template).save(out_dir)
    return load_tokenizer(out_dir)
