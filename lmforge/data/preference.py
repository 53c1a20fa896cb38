"""Preference data for DPO: (prompt, chosen, rejected) rows → token ids with response-only labels.

Rows come from the same sources as SFT data (`lmforge.data.sft.read_records`: local .json list,
.jsonl, .parquet, or a Hugging Face dataset name) and follow the same error rules. Layouts:

* `{"prompt": str, "chosen": str, "rejected": str}`: the prompt is one user message, each
  response one assistant message.
* `prompt` as a list of chat messages (a conversation so far) and `chosen` / `rejected` as text,
  one assistant message or a list of assistant messages.
* `chosen` / `rejected` as whole conversations (Anthropic HH, UltraFeedback binarized): their
  common leading messages are the prompt (a `prompt` field is then ignored) and what follows
  in each is its response, which must be assistant messages only.

Tokenization renders prompt + response with the chat template; the labels are the response's
assistant tokens (content + end-of-turn), found by prefix rendering as in SFT, and everything
before the response (the prompt with its generation prompt) is labelled IGNORE_INDEX.

Truncation policy (each of chosen / rejected is at most `max_seq_len` positions, i.e.
`max_seq_len + 1` ids, and both keep the same prompt): when prompt + the longer response is too
long, the responses are cut from their end first, down to what the prompt leaves, but to no fewer
than `max_seq_len // 2` ids; if that is still too long, the prompt is cut from the left (after
its BOS token, which stays first). Every response therefore keeps at least one labelled token.

Batches (`PreferenceLoader`, same order and state conventions as `SFTLoader`): `chosen_inputs`,
`chosen_labels`, `rejected_inputs`, `rejected_labels`, each [b, s] int64, all four padded to one
length s (the longest of the batch, or max_seq_len) with `pad_id` / IGNORE_INDEX, so a DPO loss
can run one forward over `torch.cat([chosen_inputs, rejected_inputs])` [2b, s].
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmforge.data.sft import (
    IGNORE_INDEX,
    DataSourceSection,
    Record,
    RowProblem,
    ShuffledLoader,
    check_messages,
    describe_source,
    pad_rows,
    parse_rows,
    shift_labels,
    tokenize_conversation,
)
from lmforge.errors import DataError

logger = logging.getLogger(__name__)


class PreferenceDataSection(DataSourceSection):
    """Preference pairs for `lmforge dpo`."""

    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"


@dataclass(frozen=True)
class PreferencePair:
    """A pair as chat messages: a shared prompt and two assistant responses."""

    prompt: list[dict[str, str]]
    chosen: list[dict[str, str]]
    rejected: list[dict[str, str]]


def _as_messages(value: Any, name: str, *, role: str) -> list[dict[str, str]]:
    """Text (one `role` message), one message object, or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Mapping):
        return check_messages([value], name)
    return check_messages(value, name)


def preference_pair(record: Any, cfg: PreferenceDataSection) -> PreferencePair:
    """The prompt and the two responses of one row (see the module docstring), or RowProblem."""
    if not isinstance(record, Mapping):
        raise RowProblem(
            f"expected an object with {cfg.chosen_field!r} and {cfg.rejected_field!r} fields"
        )
    for name in (cfg.chosen_field, cfg.rejected_field):
        if record.get(name) is None:
            keys = ", ".join(map(str, list(record)[:10])) or "none"
            raise RowProblem(f"missing field {name!r} (fields: {keys})")
    chosen = _as_messages(record[cfg.chosen_field], cfg.chosen_field, role="assistant")
    rejected = _as_messages(record[cfg.rejected_field], cfg.rejected_field, role="assistant")
    if any(m["role"] != "assistant" for m in chosen + rejected):
        # Whole conversations: the shared leading messages are the prompt.
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        raw_prompt = record.get(cfg.prompt_field)
        if raw_prompt is None:
            raise RowProblem(
                f"no prompt: missing field {cfg.prompt_field!r}, and {cfg.chosen_field!r} / "
                f"{cfg.rejected_field!r} are not conversations that start with it"
            )
        prompt = _as_messages(raw_prompt, cfg.prompt_field, role="user")
    if not prompt:
        raise RowProblem(
            f"{cfg.chosen_field!r} and {cfg.rejected_field!r} share no leading messages, so there "
            f"is no prompt; give a {cfg.prompt_field!r} field or conversations with a common start"
        )
    for name, response in ((cfg.chosen_field, chosen), (cfg.rejected_field, rejected)):
        if not response:
            raise RowProblem(
                f"{name!r} has no response after the prompt (chosen and rejected must differ "
                "in their final assistant message)"
            )
        if not any(str(m["content"]).strip() for m in response):
            raise RowProblem(f"{name!r} is empty: a preference pair needs two non-empty responses")
        odd = next((m["role"] for m in response if m["role"] != "assistant"), None)
        if odd is not None:
            raise RowProblem(
                f"{name!r} goes on with a {odd} message after the shared prompt; the responses "
                "must be assistant messages only"
            )
    return PreferencePair(prompt, chosen, rejected)


@dataclass(frozen=True)
class PreferenceSample:
    """A tokenized pair: inputs / labels int64 [n] for each response (prompt shared)."""

    chosen_inputs: np.ndarray
    chosen_labels: np.ndarray
    rejected_inputs: np.ndarray
    rejected_labels: np.ndarray
    where: str = ""

    def __len__(self) -> int:
        return int(max(self.chosen_inputs.size, self.rejected_inputs.size))


def tokenize_pair(
    tokenizer, pair: PreferencePair, *, max_seq_len: int, where: str = ""
) -> tuple[PreferenceSample, bool]:
    """Render and label one pair and apply the truncation policy (module docstring).

    Returns:
        (sample, truncated).
    """
    num_prompt = len(pair.prompt)
    encoded = []
    for response in (pair.chosen, pair.rejected):
        ids, trained = tokenize_conversation(
            tokenizer, pair.prompt + response, first_trained_message=num_prompt, where=where
        )
        encoded.append((np.asarray(ids, dtype=np.int64), trained))
    # The prompt ends where the first response's first trained token starts.
    prompt_len = int(np.argmax(encoded[0][1]))
    assert np.array_equal(encoded[0][0][:prompt_len], encoded[1][0][:prompt_len])

    limit = max_seq_len + 1  # ids per sequence
    longest = max(ids.size for ids, _ in encoded) - prompt_len
    truncated = prompt_len + longest > limit
    keep_prompt = np.arange(prompt_len)
    keep_response = longest
    if truncated:
        keep_response = min(longest, max(limit - prompt_len, max_seq_len // 2))
        excess = prompt_len + keep_response - limit
        if excess > 0:
            first = 1 if encoded[0][0][0] == tokenizer.bos_id else 0
            keep_prompt = np.concatenate([keep_prompt[:first], keep_prompt[first + excess :]])
    arrays = []
    for ids, trained in encoded:
        keep = np.concatenate([keep_prompt, np.arange(prompt_len, ids.size)[:keep_response]])
        arrays.extend(shift_labels(ids[keep], trained[keep]))
    return PreferenceSample(*arrays, where=where), truncated


@dataclass
class PreferenceDataset:
    """Tokenized preference pairs and what happened to the rows on the way."""

    samples: list[PreferenceSample]
    num_rows: int = 0
    num_bad_rows: int = 0
    num_truncated: int = 0

    def summary(self) -> dict[str, int]:
        return {
            "num_rows": self.num_rows,
            "num_pairs": len(self.samples),
            "num_bad_rows": self.num_bad_rows,
            "num_truncated": self.num_truncated,
        }


def load_preference_data(
    cfg: PreferenceDataSection, tokenizer, *, heldout: bool = False
) -> PreferenceDataset:
    """Read, validate and tokenize the configured preference rows (or the held-out ones).

    Raises:
        DataError: a malformed row as `file:line: reason` (unless `skip_bad_rows`), too many
            malformed rows, or no pair at all.
    """

    def parse(record: Record) -> tuple[PreferenceSample, bool]:
        pair = preference_pair(record.value, cfg)
        return tokenize_pair(tokenizer, pair, max_seq_len=cfg.max_seq_len, where=record.where)

    results, num_rows, num_bad_rows = parse_rows(cfg, parse, heldout=heldout)
    data = PreferenceDataset(
        samples=[sample for sample, _ in results],
        num_rows=num_rows,
        num_bad_rows=num_bad_rows,
        num_truncated=sum(truncated for _, truncated in results),
    )
    if not data.samples:
        raise DataError(
            f"no usable preference pair in {describe_source(cfg, heldout=heldout)} "
            f"({num_rows} rows, {num_bad_rows} malformed)"
        )
    if data.num_truncated:
        logger.warning(
            "%d of %d pairs truncated to max_seq_len=%d",
            data.num_truncated,
            len(data.samples),
            cfg.max_seq_len,
        )
    logger.info("preference data: %s", data.summary())
    return data


class PreferenceLoader(ShuffledLoader):
    """Endless iterator of DPO micro-batches for one data-parallel rank.

    `PreferenceLoader(samples, *, micro_batch_size, dp_rank=0, dp_size=1, seed=0, max_seq_len,
    pad_id=0, pad_to_max_seq_len=False)`, or `PreferenceLoader.from_section(samples, cfg,
    tokenizer, ...)`. Each batch: `chosen_inputs`, `chosen_labels`, `rejected_inputs`,
    `rejected_labels`, all [b, s] int64 with one s (longest sequence of the batch, or
    max_seq_len).
    """

    def _collate(self, items: list[int]) -> dict[str, torch.Tensor]:
        pairs = [self.samples[i] for i in items]
        length = self._padded_length([len(p) for p in pairs])
        batch = {}
        for side in ("chosen", "rejected"):
            inputs = [getattr(p, f"{side}_inputs") for p in pairs]
            labels = [getattr(p, f"{side}_labels") for p in pairs]
            batch[f"{side}_inputs"] = pad_rows(inputs, length, self.pad_id)
            batch[f"{side}_labels"] = pad_rows(labels, length, IGNORE_INDEX)
        return batch


__all__ = [
    "PreferenceDataSection",
    "PreferenceDataset",
    "PreferenceLoader",
    "PreferencePair",
    "PreferenceSample",
    "load_preference_data",
    "preference_pair",
    "tokenize_pair",
]
