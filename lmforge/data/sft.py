"""Instruction data for SFT: rows → chat messages → token ids with assistant-only labels → batches.

Rows come from local files (`.json` holding a JSON list, `.jsonl`, `.parquet`; `.json`/`.jsonl`
may be gzipped) or a Hugging Face dataset name (through `datasets`). Row formats:

* Alpaca: `{"instruction", "input" (optional), "output"}` becomes one user message
  (`instruction`, plus `"\\n\\n" + input` when the input is non-empty) and one assistant message.
* Chat: `{"messages": [{"role", "content"}, ...]}` with system / user / assistant turns, as many as
  wanted; the conversation must end with an assistant message.
* ShareGPT: `{"conversations": [{"from", "value"}, ...]}`, `from` being system, human (or user)
  and gpt (or assistant): the same conversation in ShareGPT's names.
* Prompt/completion (TRL's standard form): `{"prompt": str, "completion": str}` becomes one user
  and one assistant message, as Alpaca does; the conversational variant, `prompt` and
  `completion` as lists of messages, is the conversation prompt + completion whose trained turns
  are the completion's assistant messages only (assistant turns inside the prompt are context).

Rendering uses the tokenizer's chat template (`Tokenizer.encode_chat`; a Llama 3 vocabulary
without a template gets Llama 3's). Which tokens are trained is found by rendering prefixes, so it
holds for any template: assistant turn i covers the ids from the end of
`messages[:i]` + generation prompt up to the end of `messages[:i+1]` (its content and its
end-of-turn token). Each prefix must render to a token prefix of the whole conversation; a template
for which that fails is refused (`ModelFormatError`), since its labels could not be trusted. With
`train_on_input=False` (default) every other token is labelled IGNORE_INDEX; every assistant turn
of a multi-turn conversation is trained. With `train_on_input=True` every token is a target.

A sample of n token ids gives inputs `ids[:-1]` and labels `ids[1:]` (masked), n - 1 positions.
Truncation policy: a sample keeps its first `max_seq_len + 1` ids (so at most `max_seq_len`
positions), cutting from the end; a sample with no trained label left after the cut is dropped
and counted (`SFTDataset.num_dropped`), never silently kept as a no-op.

Batches: unpacked, each row of the micro-batch is one sample, right-padded with `pad_id` (labels
IGNORE_INDEX) to the longest sample of the batch, or to `max_seq_len` with `pad_to_max_seq_len`.
Packed (`pack=True`), samples are concatenated in dataset order, greedily, into sequences of
exactly `max_seq_len` positions (a sample never straddles two sequences; the rest is padding) and
the batch also carries `document_ids` [b, s] int32 (0, 1, ... per sample, padding is one more
document) and `positions` [b, s] int64 (restarting at 0 per sample): the same keys as
`lmforge.data.pretrain.PackedLoader`, whose `build_block_causal_mask` keeps attention inside a
sample, and labels never cross samples because each sample's last input predicts its own last id.

Order and state (`ShuffledLoader`, shared with preference data): items (samples, or packed
sequences) are visited epoch by epoch in the permutation drawn by `numpy.random.default_rng([seed,
epoch])`; each step takes `micro_batch_size * dp_size` consecutive global items and data-parallel
rank r takes items `base + r + k * dp_size`, as `PackedLoader` does. The state is the number of
global items consumed; restoring it gives the exact next batch, also under another dp_size.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from pydantic import Field, field_validator

from lmforge.config import Section
from lmforge.data.prepare import (
    BadRows,
    _first_line,
    _import_pyarrow,
    _looks_unreachable,
    _read_lines,
    expand_inputs,
)
from lmforge.data.prepare import _json_type as _json_kind
from lmforge.data.tokenizer import CHAT_ROLES
from lmforge.errors import ConfigError, DataError, ModelFormatError, UserError

logger = logging.getLogger(__name__)
# Label of a position that is not trained on (the prompt, padding): cross entropy skips it.
IGNORE_INDEX = -100
T = TypeVar("T")

STATE_VERSION = 1
# File suffixes (after an optional .gz) read as data; .json may hold a list or JSON lines.
DATA_SUFFIXES = {".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}

# ----------------------------------------------------------------------------------------------
# Config


class DataSourceSection(Section):
    """Where rows come from and how malformed or long ones are handled (shared by SFT and DPO)."""

    path: list[str] = Field(default_factory=list)
    """Local files or directories (.json list, .jsonl, .parquet; optionally .gz) or globs."""
    dataset: str | None = None
    """A Hugging Face dataset name instead of `path` (needs `pip install datasets`)."""
    dataset_config: str | None = None
    split: str = "train"
    heldout: list[str] = Field(default_factory=list)
    """Local files of held-out rows, read the same way, for evaluation."""
    max_seq_len: int = Field(2048, ge=2)
    """Most positions (tokens fed to the model) per sample; see the truncation policy."""
    pad_to_max_seq_len: bool = False
    """Pad every batch to max_seq_len (fixed shapes) instead of to its longest sample."""
    skip_bad_rows: bool = False
    """Count and log malformed rows instead of stopping at the first one."""
    max_bad_fraction: float = Field(0.01, ge=0, le=1)
    """With skip_bad_rows: fail when more than this fraction of the rows is malformed."""

    @field_validator("path", "heldout", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class SFTDataSection(DataSourceSection):
    """Instruction data for `lmforge sft` (Alpaca, chat, ShareGPT or prompt/completion rows)."""

    format: Literal["auto", "alpaca", "chat", "sharegpt", "prompt_completion"] = "auto"
    """`auto` decides per row: a `messages_field` means chat, a `conversations_field` ShareGPT,
    an `instruction_field` Alpaca, a `prompt_field` or `completion_field` prompt/completion."""
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    messages_field: str = "messages"
    conversations_field: str = "conversations"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    train_on_input: bool = False
    """Also train on system/user tokens and chat-template tokens (default: assistant only)."""
    pack: bool = False
    """Concatenate several samples per sequence of max_seq_len (attention stays per sample)."""


# ----------------------------------------------------------------------------------------------
# Reading rows


@dataclass(frozen=True)
class Record:
    """One row as decoded: its value, or why it could not be decoded. `where` is `file:line`
    (`file:ROW` for parquet, `name[split]:ROW` for a hub dataset)."""

    where: str
    value: Any = None
    problem: str | None = None


class RowProblem(Exception):
    """Raised by the row parsers with the reason a row is malformed (its place is added later)."""


def _detect_format(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return DATA_SUFFIXES.get(suffixes[-1]) if suffixes else None


def resolve_files(paths: Sequence[str], *, key: str = "path") -> list[tuple[Path, str]]:
    """(file, format) for each input: a file, a directory (its data files, sorted) or a glob.

    Raises:
        DataError: naming the input that matches nothing or whose format is unknown.
    """
    known = ", ".join(DATA_SUFFIXES)
    files: list[tuple[Path, str]] = []
    for item in paths:
        found = expand_inputs(
            item, is_data_file=lambda p: bool(_detect_format(p)), known=known, key=key
        )
        for file in found:
            file_format = _detect_format(file)
            if file_format is None:
                raise DataError(
                    f"{file}: cannot tell the format from the suffix; use one of {known} "
                    "(optionally .gz): .json holds a JSON list, .jsonl one object per line"
                )
            files.append((file, file_format))
    return files


def _json_line_records(path: Path, lines: Iterator[tuple[int, bytes]]) -> Iterator[Record]:
    for number, raw in lines:
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield Record(where, json.loads(raw.decode("utf-8")))
        except UnicodeDecodeError as err:
            yield Record(where, problem=f"not UTF-8 text (byte {err.start} of the line)")
        except json.JSONDecodeError as err:
            yield Record(where, problem=f"invalid JSON: {err.msg} (column {err.colno})")


def _json_list_records(path: Path) -> Iterator[Record]:
    """Elements of a JSON list, each with the line it starts on. A file that does not start with
    `[` is read as JSON lines (many `.json` downloads are). A syntax error inside the list cannot
    be skipped (the rest cannot be told apart) and is always raised."""
    data = b"".join(_read_lines(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {err.start})") from None
    index = _skip_space(text, 0)
    if not text.startswith("[", index):
        yield from _json_line_records(path, enumerate(data.splitlines(), start=1))
        return
    decoder = json.JSONDecoder()
    line, counted = 1, 0

    def line_of(position: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, position)
        counted = position
        return line

    index = _skip_space(text, index + 1)
    if text.startswith("]", index):
        return
    while True:
        try:
            value, end = decoder.raw_decode(text, index)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}:{err.lineno}: invalid JSON: {err.msg} (column {err.colno})"
            ) from None
        yield Record(f"{path}:{line_of(index)}", value)
        index = _skip_space(text, end)
        if text.startswith(",", index):
            index = _skip_space(text, index + 1)
            continue
        if text.startswith("]", index) and not text[index + 1 :].strip():
            return
        raise DataError(
            f"{path}:{line_of(index)}: invalid JSON: expected ',' or a final ']' after a list item"
        )


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    return index


def _parquet_records(path: Path) -> Iterator[Record]:
    pa, pq = _import_pyarrow()
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: not a readable parquet file: {_first_line(err)}") from None
    number = 0
    try:
        for batch in parquet.iter_batches(batch_size=1024):
            for value in batch.to_pylist():
                number += 1
                yield Record(f"{path}:{number}", value)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: cannot read row {number + 1}: {_first_line(err)}") from None


def _dataset_records(name: str, config: str | None, split: str) -> Iterator[Record]:
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"dataset {name!r} needs the datasets package (pip install datasets, or "
            "pip install 'lmforge[data]'); or pass local .json/.jsonl/.parquet files as path"
        ) from None
    described = name + (f" (config {config})" if config else "")
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # datasets raises many unrelated types for the same problems
        if _looks_unreachable(err):
            raise DataError(
                f"cannot reach the Hugging Face hub to load dataset {described}, split {split!r} "
                f"({_first_line(err)}); pass local .json/.jsonl/.parquet files as path instead"
            ) from None
        raise DataError(
            f"cannot load dataset {described}, split {split!r}: {_first_line(err)}"
        ) from None
    for number, value in enumerate(dataset, start=1):
        yield Record(f"{name}[{split}]:{number}", value)


def read_records(cfg: DataSourceSection, *, heldout: bool = False) -> Iterator[Record]:
    """Every row of the configured source (`cfg.heldout` files with `heldout=True`), in order.

    Raises:
        ConfigError: neither or both of `path` and `dataset` are set, or no held-out files.
        DataError / UserError: unreadable files, unreachable or missing datasets.
    """
    if heldout:
        if not cfg.heldout:
            raise ConfigError("data.heldout is not set: give the held-out data files")
        sources = resolve_files(cfg.heldout, key="data.heldout")
    elif cfg.path and cfg.dataset:
        raise ConfigError(
            f"data.path ({', '.join(cfg.path)}) and data.dataset ({cfg.dataset}) are both set; "
            "give one of them"
        )
    elif cfg.dataset:
        yield from _dataset_records(cfg.dataset, cfg.dataset_config, cfg.split)
        return
    elif not cfg.path:
        raise ConfigError(
            "no training data: set data.path (local .json/.jsonl/.parquet files) "
            "or data.dataset (a Hugging Face dataset name)"
        )
    else:
        sources = resolve_files(cfg.path, key="data.path")
    for file, file_format in sources:
        if file_format == "json":
            yield from _json_list_records(file)
        elif file_format == "jsonl":
            yield from _json_line_records(file, enumerate(_read_lines(file), start=1))
        else:
            yield from _parquet_records(file)


def parse_rows(
    cfg: DataSourceSection, parse: Callable[[Record], T], *, heldout: bool = False
) -> tuple[list[T], int, int]:
    """`parse` every row of the configured source, applying the malformed-row rules.

    `parse` raises `RowProblem` (or `DataError`, e.g. a template refusing the messages) for a
    malformed row: it is raised as `file:line: reason`, or counted and skipped with
    `skip_bad_rows` (and the fraction capped by `max_bad_fraction`).

    Returns:
        (results of the good rows in order, number of rows, number of malformed rows).
    """
    bad = BadRows(
        cfg.skip_bad_rows,
        cfg.max_bad_fraction,
        option="data.skip_bad_rows=true",
        fraction_option="data.max_bad_fraction",
    )
    results: list[T] = []
    num_rows = 0
    for record in read_records(cfg, heldout=heldout):
        num_rows += 1
        problem = record.problem
        if problem is None:
            try:
                results.append(parse(record))
            except (RowProblem, DataError) as err:
                problem = str(err)
        if problem is not None:
            bad.add(record.where, problem)
    bad.check(num_rows)
    return results, num_rows, bad.count


def describe_source(cfg: DataSourceSection, *, heldout: bool = False) -> str:
    """The configured files or dataset, for messages."""
    return ", ".join(cfg.heldout if heldout else cfg.path) or str(cfg.dataset)


# ----------------------------------------------------------------------------------------------
# Rows → chat messages


def _json_type(value: Any) -> str:
    return "a string" if isinstance(value, str) else _json_kind(value)


def _field(record: Mapping[str, Any], name: str, *, required: bool = True) -> Any:
    if name not in record:
        if not required:
            return None
        keys = ", ".join(map(str, list(record)[:10])) or "none"
        raise RowProblem(f"missing field {name!r} (fields: {keys})")
    return record[name]


def _as_object(record: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(record, Mapping):
        raise RowProblem(f"expected an object with {what}, got {_json_type(record)}")
    return record


def check_messages(value: Any, name: str) -> list[dict[str, str]]:
    """`value` as a non-empty list of `{"role", "content"}` (content a string), or RowProblem."""
    if not isinstance(value, list):
        raise RowProblem(f"field {name!r} is {_json_type(value)}, expected a list of messages")
    if not value:
        raise RowProblem(f"field {name!r} is an empty list of messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise RowProblem(
                f"{name}[{index}] is {_json_type(message)}, expected an object with "
                "'role' and 'content'"
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RowProblem(
                f"{name}[{index}] has unknown role {role!r}; allowed: {', '.join(CHAT_ROLES)}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise RowProblem(
                f"{name}[{index}] ({role}) has content {_json_type(content)}, expected a string"
            )
        messages.append({"role": role, "content": content})
    return messages


SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


def _from_sharegpt(value: Any, name: str) -> Any:
    """ShareGPT turns ({"from", "value"}) as chat messages; anything else is left for
    `check_messages` to name."""
    if not isinstance(value, list):
        return value
    messages = []
    for index, turn in enumerate(value):
        if not isinstance(turn, Mapping) or "from" not in turn:
            raise RowProblem(f"{name}[{index}] is not a ShareGPT turn with 'from' and 'value'")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise RowProblem(
                f"{name}[{index}] has unknown 'from' {turn['from']!r}; allowed: "
                f"{', '.join(SHAREGPT_ROLES)}"
            )
        messages.append({"role": role, "content": turn.get("value")})
    return messages


def _text_field(record: Mapping[str, Any], name: str, *, required: bool = True) -> str | None:
    value = _field(record, name, required=required)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise RowProblem(f"field {name!r} is {_json_type(value)}, expected a string")
    return value


def _ends_with_assistant(messages: list[dict[str, str]], what: str) -> None:
    if messages[-1]["role"] != "assistant":
        raise RowProblem(
            f"{what} ends with a {messages[-1]['role']} message; "
            "it must end with an assistant message (the response to train on)"
        )


def _prompt_completion(
    record: Mapping[str, Any], cfg: SFTDataSection
) -> tuple[list[dict[str, str]], int]:
    """A prompt/completion row as (messages, index of the first trained message): text as one
    user and one assistant message, lists of messages as prompt + completion."""
    prompt_name, completion_name = cfg.prompt_field, cfg.completion_field
    prompt = _field(record, prompt_name)
    completion = _field(record, completion_name)
    if isinstance(prompt, str) and isinstance(completion, str):
        for name, text in ((prompt_name, prompt), (completion_name, completion)):
            if not text.strip():
                raise RowProblem(f"field {name!r} is empty")
        messages = [{"role": "user", "content": prompt}]
        return [*messages, {"role": "assistant", "content": completion}], 0
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt_messages = check_messages(prompt, prompt_name)
        completion_messages = check_messages(completion, completion_name)
        _ends_with_assistant(completion_messages, f"field {completion_name!r}")
        return prompt_messages + completion_messages, len(prompt_messages)
    raise RowProblem(
        f"field {prompt_name!r} is {_json_type(prompt)} and {completion_name!r} is "
        f"{_json_type(completion)}; give both as strings or both as lists of messages"
    )


def sft_conversation(record: Any, cfg: SFTDataSection) -> tuple[list[dict[str, str]], int]:
    """The chat messages of one SFT row (per `cfg.format`), or RowProblem.

    Returns:
        (messages, first_trained_message): assistant messages before that index are not trained
        (the prompt of a conversational prompt/completion row; 0 for the other forms).
    """
    fmt = cfg.format
    if fmt == "auto":
        if isinstance(record, Mapping) and cfg.messages_field in record:
            fmt = "chat"
        elif isinstance(record, Mapping) and cfg.conversations_field in record:
            fmt = "sharegpt"
        elif isinstance(record, Mapping) and cfg.instruction_field in record:
            fmt = "alpaca"
        elif isinstance(record, Mapping) and (
            cfg.prompt_field in record or cfg.completion_field in record
        ):
            fmt = "prompt_completion"
        else:
            keys = ", ".join(map(str, list(record)[:10])) if isinstance(record, Mapping) else ""
            raise RowProblem(
                f"no {cfg.messages_field!r} field (chat), {cfg.conversations_field!r} field "
                f"(ShareGPT), {cfg.instruction_field!r} field (alpaca) or {cfg.prompt_field!r} "
                f"and {cfg.completion_field!r} fields (prompt/completion)"
                + (f"; fields: {keys}" if keys else f"; got {_json_type(record)}")
            )
    if fmt in ("chat", "sharegpt"):
        name = cfg.messages_field if fmt == "chat" else cfg.conversations_field
        record = _as_object(record, f"a {name!r} field")
        value = _field(record, name)
        messages = check_messages(_from_sharegpt(value, name) if fmt == "sharegpt" else value, name)
        _ends_with_assistant(messages, "the conversation")
        return messages, 0
    if fmt == "prompt_completion":
        what = f"{cfg.prompt_field!r} and {cfg.completion_field!r} fields"
        return _prompt_completion(_as_object(record, what), cfg)
    record = _as_object(record, f"{cfg.instruction_field!r} and {cfg.output_field!r} fields")
    instruction = _text_field(record, cfg.instruction_field)
    extra = _text_field(record, cfg.input_field, required=False)
    output = _text_field(record, cfg.output_field)
    user = instruction + "\n\n" + extra if extra and extra.strip() else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}], 0


# ----------------------------------------------------------------------------------------------
# Messages → ids and labels


def _check_template(tokenizer) -> None:
    if tokenizer.chat_template is None:
        raise ModelFormatError(
            f"tokenizer {tokenizer.source} has no chat template and no Llama 3 header tokens "
            "(<|start_header_id|>, <|eot_id|>); give a tokenizer with a chat_template in its "
            "tokenizer_config.json (model.tokenizer=...)"
        )


def tokenize_conversation(
    tokenizer,
    messages: Sequence[Mapping[str, str]],
    *,
    train_on_input: bool = False,
    first_trained_message: int = 0,
    where: str = "",
) -> tuple[list[int], np.ndarray]:
    """Token ids of a rendered conversation and which of them are trained.

    Args:
        tokenizer: a `lmforge.data.tokenizer.Tokenizer` with a chat template.
        messages: the conversation.
        train_on_input: every id is trained, not only the assistant turns.
        first_trained_message: assistant turns before this message index are not trained
            (preference data: the prompt's own assistant turns).
        where: `file:line`, for errors.

    Returns:
        (ids, trained): ids of the whole conversation and bool [len(ids)], True for the ids of
        each assistant turn from `first_trained_message` on (its content and end-of-turn token).

    Raises:
        ModelFormatError: the template does not render prefixes as token prefixes.
        DataError: the template refused the messages.
    """
    _check_template(tokenizer)
    ids = tokenizer.encode_chat(messages)
    trained = np.full(len(ids), train_on_input, dtype=bool)
    if train_on_input:
        return ids, trained

    def prefix_length(num_messages: int, generation_prompt: bool) -> int:
        prefix = tokenizer.encode_chat(
            messages[:num_messages], add_generation_prompt=generation_prompt
        )
        if ids[: len(prefix)] != prefix:
            shown = f"messages[:{num_messages}]" + " + generation prompt" * generation_prompt
            raise ModelFormatError(
                f"{where + ': ' if where else ''}the chat template of tokenizer "
                f"{tokenizer.source} is not prefix-stable: {shown} does not render to a token "
                "prefix of the whole conversation, so the assistant tokens cannot be located; "
                "use a template that renders earlier turns the same whatever follows"
            )
        return len(prefix)

    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < first_trained_message:
            continue
        start = prefix_length(index, True)
        end = len(ids) if index + 1 == len(messages) else prefix_length(index + 1, False)
        trained[start:end] = True
    return ids, trained


def shift_labels(ids: np.ndarray, trained: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) int64 [n - 1] of n ids: labels are the next id where it is trained."""
    ids = np.asarray(ids, dtype=np.int64)
    labels = np.where(trained[1:], ids[1:], IGNORE_INDEX)
    return ids[:-1].copy(), labels


@dataclass(frozen=True)
class SFTSample:
    """One tokenized sample: inputs and labels int64 [n] (n <= max_seq_len)."""

    inputs: np.ndarray
    labels: np.ndarray
    where: str = ""

    def __len__(self) -> int:
        return int(self.inputs.size)


def sft_sample(
    ids: Sequence[int], trained: np.ndarray, *, max_seq_len: int, where: str = ""
) -> tuple[SFTSample | None, bool]:
    """Apply the truncation policy (module docstring) to one conversation's ids.

    Returns:
        (sample, truncated): sample is None when no trained label is left after truncation.
    """
    truncated = len(ids) > max_seq_len + 1
    ids = np.asarray(ids[: max_seq_len + 1], dtype=np.int64)
    inputs, labels = shift_labels(ids, trained[: max_seq_len + 1])
    if not (labels != IGNORE_INDEX).any():
        return None, truncated
    return SFTSample(inputs, labels, where), truncated


@dataclass
class SFTDataset:
    """Tokenized SFT samples and what happened to the rows on the way."""

    samples: list[SFTSample]
    num_rows: int = 0
    num_bad_rows: int = 0
    num_truncated: int = 0
    num_dropped: int = 0
    """Rows left without any trained label by truncation (assistant turns beyond max_seq_len)."""
    num_label_tokens: int = 0

    def summary(self) -> dict[str, int]:
        return {
            "num_rows": self.num_rows,
            "num_samples": len(self.samples),
            "num_bad_rows": self.num_bad_rows,
            "num_truncated": self.num_truncated,
            "num_dropped": self.num_dropped,
            "num_tokens": sum(len(s) for s in self.samples),
            "num_label_tokens": self.num_label_tokens,
        }


def load_sft_data(cfg: SFTDataSection, tokenizer, *, heldout: bool = False) -> SFTDataset:
    """Read, validate and tokenize the configured SFT rows (or the held-out ones).

    Raises:
        DataError: a malformed row as `file:line: reason` (unless `skip_bad_rows`), too many
            malformed rows, or no usable sample at all.
    """
    _check_template(tokenizer)

    def parse(record: Record) -> tuple[SFTSample | None, bool]:
        messages, first_trained = sft_conversation(record.value, cfg)
        ids, trained = tokenize_conversation(
            tokenizer,
            messages,
            train_on_input=cfg.train_on_input,
            first_trained_message=first_trained,
            where=record.where,
        )
        return sft_sample(ids, trained, max_seq_len=cfg.max_seq_len, where=record.where)

    results, num_rows, num_bad_rows = parse_rows(cfg, parse, heldout=heldout)
    data = SFTDataset(samples=[], num_rows=num_rows, num_bad_rows=num_bad_rows)
    for sample, truncated in results:
        data.num_truncated += truncated
        if sample is None:
            data.num_dropped += 1
            continue
        data.samples.append(sample)
        data.num_label_tokens += int((sample.labels != IGNORE_INDEX).sum())
    if data.num_dropped:
        logger.warning(
            "%d of %d rows dropped: no assistant token left within max_seq_len=%d",
            data.num_dropped,
            data.num_rows,
            cfg.max_seq_len,
        )
    if not data.samples:
        raise DataError(
            f"no usable SFT sample in {describe_source(cfg, heldout=heldout)} ({num_rows} rows, "
            f"{num_bad_rows} malformed, {data.num_dropped} without a label left after "
            f"truncation to max_seq_len={cfg.max_seq_len})"
        )
    logger.info("SFT data: %s", data.summary())
    return data


# ----------------------------------------------------------------------------------------------
# Loaders


def pad_rows(rows: Sequence[np.ndarray], length: int, value: int) -> torch.Tensor:
    """int64 [len(rows), length]: each row right-padded with `value`."""
    out = np.full((len(rows), length), value, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : row.size] = row
    return torch.from_numpy(out)


def samples_hash(samples: Sequence[Any]) -> str:
    """A short hash of the tokenized samples' arrays (a resumed run refuses other data)."""
    digest = hashlib.sha256()
    for sample in samples:
        for array in vars(sample).values():
            if isinstance(array, np.ndarray):
                digest.update(np.int64(array.size).tobytes())
                digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def default_pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS, else 0 (padding is never attended or trained)."""
    for candidate in (tokenizer.pad_id, tokenizer.eos_id):
        if candidate is not None:
            return int(candidate)
    return 0


class ShuffledLoader:
    """Endless, per-epoch shuffled micro-batches of tokenized samples for one data-parallel rank.

    Items are the samples, or groups of them (`num_items`, e.g. packed sequences). Subclasses
    define `_collate(items) -> batch`. See the module docstring for the order and the state;
    `identity` (with the seed, item count, data hash and max_seq_len) must match for a saved
    state to continue the same order.
    """

    def __init__(
        self,
        samples: Sequence[Any],
        *,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        max_seq_len: int,
        pad_id: int = 0,
        pad_to_max_seq_len: bool = False,
        width_multiple: int = 1,
        num_items: int | None = None,
        identity: Mapping[str, int | str | bool] | None = None,
    ):
        if micro_batch_size < 1 or dp_size < 1:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and dp_size ({dp_size}) must be >= 1"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not samples:
            raise DataError("no samples to iterate over")
        too_long = next((s for s in samples if len(s) > max_seq_len), None)
        if too_long is not None:
            raise ValueError(
                f"sample {too_long.where} has {len(too_long)} positions > max_seq_len {max_seq_len}"
            )
        self.samples = list(samples)
        self.num_items = len(self.samples) if num_items is None else num_items
        self.max_seq_len = max_seq_len
        self.pad_id = pad_id
        self.pad_to_max_seq_len = pad_to_max_seq_len
        self.width_multiple = width_multiple
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.identity = {
            "seed": seed,
            "num_items": self.num_items,
            "data_hash": samples_hash(self.samples),
            "max_seq_len": max_seq_len,
            **dict(identity or {}),
        }
        self.items_consumed = 0  # global items, all ranks together
        self._permutations: dict[int, np.ndarray] = {}

    @classmethod
    def from_section(
        cls,
        samples: Sequence[Any],
        cfg: DataSourceSection,
        tokenizer,
        *,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        width_multiple: int = 1,
    ):
        """A loader over `samples` with the section's settings and the tokenizer's pad id;
        its batches' width a multiple of `width_multiple` (parallel.tp: sequence parallelism
        splits the positions evenly)."""
        return cls(
            samples,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            max_seq_len=cfg.max_seq_len,
            pad_id=default_pad_id(tokenizer),
            pad_to_max_seq_len=cfg.pad_to_max_seq_len,
            width_multiple=width_multiple,
            **cls._section_options(cfg),
        )

    @staticmethod
    def _section_options(cfg: DataSourceSection) -> dict[str, Any]:
        """Subclass-specific constructor arguments taken from the section."""
        return {}

    def _padded_length(self, lengths: Sequence[int] = ()) -> int:
        """A batch's width: its longest item's (or max_seq_len), up to a multiple of
        width_multiple."""
        width = self.max_seq_len if self.pad_to_max_seq_len or not lengths else max(lengths)
        return -(-width // self.width_multiple) * self.width_multiple

    @property
    def epoch(self) -> int:
        """The epoch the next item comes from."""
        return self.items_consumed // self.num_items

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self._collate(self.next_items())

    def next_items(self) -> list[int]:
        """This rank's item indices for the next micro-batch; advances the state."""
        globals_ = (
            self.items_consumed
            + self.dp_rank
            + np.arange(self.micro_batch_size, dtype=np.int64) * self.dp_size
        )
        self.items_consumed += self.micro_batch_size * self.dp_size
        return [self._item(int(g)) for g in globals_]

    def _item(self, index: int) -> int:
        epoch, position = divmod(index, self.num_items)
        permutation = self._permutations.get(epoch)
        if permutation is None:
            # Keep the current and the next epoch: one step may straddle the boundary.
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            rng = np.random.default_rng([self.seed, epoch])
            permutation = self._permutations[epoch] = rng.permutation(self.num_items)
        return int(permutation[position])

    def _collate(self, items: list[int]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """A small dict, equal on every rank; `load_state_dict` continues from it."""
        return {
            "version": STATE_VERSION,
            "items_consumed": self.items_consumed,
            "epoch": self.epoch,
            "position": self.items_consumed % self.num_items,
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
            **self.identity,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`: the next batch is the one the saved loader would have given.

        A changed dp_size or micro_batch_size continues from the same global item. Changed
        data, seed or layout cannot continue the same order and raise `UserError`.
        """
        version = int(state.get("version", -1))
        if version != STATE_VERSION:
            raise UserError(
                f"data-loader state version {version} is not supported (expected {STATE_VERSION})"
            )
        for key, ours in self.identity.items():
            saved = state.get(key)
            if saved != ours:
                raise UserError(
                    f"cannot resume the data order: the checkpoint's data loader had {key}="
                    f"{saved}, this run has {key}={ours} (the data or its settings changed); "
                    "keep them, or start a new run directory"
                )
        self.items_consumed = int(state["items_consumed"])


def pack_samples(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Greedy packing in order: sample indices per sequence, each summing to <= max_seq_len."""
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, length in enumerate(lengths):
        if length > max_seq_len:
            raise ValueError(f"sample {index} has {length} positions > max_seq_len {max_seq_len}")
        if current and used + length > max_seq_len:
            packs.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        packs.append(current)
    return packs


class SFTLoader(ShuffledLoader):
    """Endless iterator of SFT micro-batches for one data-parallel rank.

    Each batch is a dict of tensors: `inputs` and `labels` [b, s] int64 (labels IGNORE_INDEX on
    untrained and padding positions); packed batches (s = max_seq_len) also `document_ids`
    [b, s] int32 and `positions` [b, s] int64. Items are samples, or packed sequences with
    `pack=True` (packed once, in dataset order).
    """

    def __init__(
        self,
        samples: Sequence[SFTSample],
        *,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        pack: bool = False,
        max_seq_len: int,
        pad_id: int = 0,
        pad_to_max_seq_len: bool = False,
        width_multiple: int = 1,
    ):
        self.pack = pack
        self.packs = pack_samples([len(s) for s in samples], max_seq_len) if pack else None
        super().__init__(
            samples,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            max_seq_len=max_seq_len,
            pad_id=pad_id,
            pad_to_max_seq_len=pad_to_max_seq_len,
            width_multiple=width_multiple,
            num_items=len(self.packs) if pack else None,
            identity={"pack": pack},
        )

    @staticmethod
    def _section_options(cfg: DataSourceSection) -> dict[str, Any]:
        return {"pack": cfg.pack}

    def _collate(self, items: list[int]) -> dict[str, torch.Tensor]:
        if not self.pack:
            chosen = [self.samples[i] for i in items]
            length = self._padded_length([len(c) for c in chosen])
            return {
                "inputs": pad_rows([s.inputs for s in chosen], length, self.pad_id),
                "labels": pad_rows([s.labels for s in chosen], length, IGNORE_INDEX),
            }
        inputs, labels, document_ids, positions = [], [], [], []
        width = self._padded_length()  # max_seq_len, up to width_multiple
        for item in items:
            parts = [self.samples[i] for i in self.packs[item]]
            lengths = [len(s) for s in parts]
            padding = width - sum(lengths)
            inputs.append(np.concatenate([s.inputs for s in parts]))
            labels.append(np.concatenate([s.labels for s in parts]))
            # Padding forms one more document, so that it attends only to itself.
            ids = np.repeat(np.arange(len(parts) + 1, dtype=np.int32), [*lengths, padding])
            document_ids.append(ids)
            positions.append(np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]))
        return {
            "inputs": pad_rows(inputs, width, self.pad_id),
            "labels": pad_rows(labels, width, IGNORE_INDEX),
            "document_ids": torch.from_numpy(np.stack(document_ids)),
            "positions": _padded_positions(positions, width),
        }


def _padded_positions(rows: list[np.ndarray], length: int) -> torch.Tensor:
    """Positions continued as 0, 1, ... into each row's padding."""
    out = np.tile(np.arange(length, dtype=np.int64), (len(rows), 1))
    for i, row in enumerate(rows):
        out[i, : row.size] = row
        out[i, row.size :] -= row.size
    return torch.from_numpy(out)


__all__ = [
    "DataSourceSection",
    "SFTDataSection",
    "SFTDataset",
    "SFTLoader",
    "SFTSample",
    "ShuffledLoader",
    "load_sft_data",
    "parse_rows",
    "read_records",
    "sft_conversation",
    "tokenize_conversation",
]
