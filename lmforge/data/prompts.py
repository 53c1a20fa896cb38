"""Prompt rows for online RL (`lmforge grpo`): a prompt to sample completions for, plus whatever
fields the rewards read (a reference `answer`, say).

Rows come from the same sources as SFT and DPO data (`lmforge.data.sft.read_records`: local
.json list, .jsonl, .parquet, or a Hugging Face dataset name) and follow the same error rules
(`file:line: reason`, or counted with `skip_bad_rows`). A row gives its prompt as

* `prompt` text: encoded as it is (with BOS where the tokenizer adds one), no chat template;
* `messages`, a chat so far: rendered with the tokenizer's chat template and the assistant
  header, as `lmforge sft` renders its prompts (and as the engine encodes a chat prompt).

Every field of the row stays with the sample (`PromptSample.fields`) for the rewards. A prompt
must leave room for the completion: at most `max_prompt_len` tokens (data.max_seq_len minus
grpo.max_new_tokens); a longer one is a malformed row.

`PromptLoader` hands out the prompts of each rollout batch in a per-epoch shuffled order that a
checkpoint resumes exactly (`ShuffledLoader`'s state).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmforge.data.sft import (
    DataSourceSection,
    Record,
    RowProblem,
    ShuffledLoader,
    check_messages,
    describe_source,
    parse_rows,
)
from lmforge.errors import DataError

logger = logging.getLogger(__name__)


class PromptDataSection(DataSourceSection):
    """Prompts for `lmforge grpo`. data.max_seq_len bounds prompt + completion (positions the
    training forward sees); prompts get what grpo.max_new_tokens leaves."""

    prompt_field: str = "prompt"
    """Prompt text, encoded as it is (no chat template)."""
    messages_field: str = "messages"
    """A chat so far (list of {role, content}), rendered with the chat template; used where a
    row has no `prompt_field`."""


@dataclass(frozen=True)
class PromptSample:
    """A tokenized prompt and its row's fields (what the rewards read)."""

    prompt_ids: np.ndarray  # int64 [n]
    fields: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    def __len__(self) -> int:
        return int(self.prompt_ids.size)


def prompt_sample(
    record: Record, cfg: PromptDataSection, tokenizer, *, max_prompt_len: int
) -> PromptSample:
    """Tokenize one row's prompt (see the module docstring), or raise RowProblem."""
    row = record.value
    if not isinstance(row, Mapping):
        raise RowProblem(
            f"expected an object with a {cfg.prompt_field!r} or {cfg.messages_field!r} field"
        )
    if row.get(cfg.prompt_field) is not None:
        text = row[cfg.prompt_field]
        if not isinstance(text, str) or not text.strip():
            raise RowProblem(f"field {cfg.prompt_field!r} must be non-empty text")
        ids = tokenizer.encode(text, bos=tokenizer.bos_id is not None)
    elif row.get(cfg.messages_field) is not None:
        messages = check_messages(row[cfg.messages_field], cfg.messages_field)
        if messages[-1]["role"] == "assistant":
            raise RowProblem(
                f"{cfg.messages_field!r} ends with an assistant message; a prompt ends with the "
                "turn the model answers (user or system)"
            )
        if tokenizer.chat_template is None:
            raise RowProblem(
                f"{cfg.messages_field!r} needs a chat template, and tokenizer "
                f"{tokenizer.source} has none (give `prompt` text, or model.chat_template)"
            )
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    else:
        keys = ", ".join(map(str, list(row)[:10])) or "none"
        raise RowProblem(
            f"no {cfg.prompt_field!r} (text) or {cfg.messages_field!r} (chat) field "
            f"(fields: {keys})"
        )
    if len(ids) > max_prompt_len:
        raise RowProblem(
            f"the prompt has {len(ids)} tokens; at most {max_prompt_len} leave room for "
            "grpo.max_new_tokens within data.max_seq_len"
        )
    return PromptSample(np.asarray(ids, dtype=np.int64), dict(row), record.where)


@dataclass
class PromptDataset:
    samples: list[PromptSample]
    num_rows: int = 0
    num_bad_rows: int = 0

    def summary(self) -> dict[str, int]:
        return {
            "num_rows": self.num_rows,
            "num_prompts": len(self.samples),
            "num_bad_rows": self.num_bad_rows,
        }


def load_prompt_data(
    cfg: PromptDataSection, tokenizer, *, max_prompt_len: int, heldout: bool = False
) -> PromptDataset:
    """Read, validate and tokenize the configured prompt rows (or the held-out ones).

    Raises:
        DataError: a malformed row as `file:line: reason` (unless `skip_bad_rows`), too many
            malformed rows, or no prompt at all.
    """
    results, num_rows, num_bad_rows = parse_rows(
        cfg,
        lambda record: prompt_sample(record, cfg, tokenizer, max_prompt_len=max_prompt_len),
        heldout=heldout,
    )
    data = PromptDataset(samples=results, num_rows=num_rows, num_bad_rows=num_bad_rows)
    if not data.samples:
        raise DataError(
            f"no usable prompt in {describe_source(cfg, heldout=heldout)} "
            f"({num_rows} rows, {num_bad_rows} malformed)"
        )
    logger.info("prompt data: %s", data.summary())
    return data


class PromptLoader(ShuffledLoader):
    """Endless iterator of prompt batches (lists of `PromptSample`) for one data-parallel rank:
    `micro_batch_size` prompts a batch, in `ShuffledLoader`'s resumable order."""

    def _collate(self, items: list[int]) -> list[PromptSample]:  # type: ignore[override]
        return [self.samples[i] for i in items]


__all__ = [
    "PromptDataSection",
    "PromptDataset",
    "PromptLoader",
    "PromptSample",
    "load_prompt_data",
    "prompt_sample",
]
