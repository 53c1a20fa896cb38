"""One sequence's progress through the engine: its prompt, settings, the tokens and text it has
produced, and its stop conditions (stop token, stop string, length).

`Sequence.push(token)` takes one generated token and returns the `TokenEvent` to stream: the text
that became final with it (text that could still be the start of a stop string is held back,
and so are the bytes of an incomplete UTF-8 character).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceType
from dataclasses import dataclass, field
from typing import Any

import torch

from lmforge.errors import ConfigError
from lmforge.generate.sampling import SamplingParams

# A prompt: text (encoded with BOS), a chat (a list of {"role", "content"} messages, encoded
# with the chat template and the assistant header), or token ids as they are.
Prompt = str | SequenceType[Mapping[str, Any]] | SequenceType[int]


@dataclass(slots=True)
class TokenEvent:
    """One new token of one sequence, as streamed."""

    index: int  # which prompt (or choice) of the call
    token_id: int
    text: str  # text that became final with this token (may be "")
    finish_reason: str | None = None  # "stop" or "length" on the sequence's last event
    logprob: float | None = None  # of the chosen token, when asked for
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    is_stop_token: bool = False  # the token ended the sequence and is not part of the text


@dataclass
class GenerationResult:
    index: int
    prompt_ids: list[int]
    token_ids: list[int]  # everything generated, including a final stop token
    text: str  # the new text, without the stop token and cut before a stop string
    finish_reason: str  # "stop" (stop token or string) or "length" (max_new_tokens / context)
    stop: int | str | None = None  # the stop token id or stop string that ended it


def encode_prompt(prompt: Prompt, tokenizer, *, vocab_size: int) -> list[int]:
    """Token ids of a prompt: text gets BOS (when the tokenizer has one), a chat (a list of
    {"role", "content"} messages) is rendered with the chat template and the assistant header,
    token ids are checked against the vocabulary and kept."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError("a text prompt needs a tokenizer; this model has none")
        return tokenizer.encode(prompt, bos=tokenizer.bos_id is not None)
    if isinstance(prompt, SequenceType) and prompt and isinstance(prompt[0], Mapping):
        if tokenizer is None:
            raise ConfigError("a chat prompt needs a tokenizer; this model has none")
        return tokenizer.encode_chat(prompt, add_generation_prompt=True)
    if isinstance(prompt, SequenceType | torch.Tensor):
        ids = [int(i) for i in prompt]
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ConfigError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
            )
        return ids
    raise ConfigError(
        "a prompt is a string, a list of chat messages or a list of token ids, not "
        f"{type(prompt).__name__}"
    )


class IncrementalText:
    """Text of a growing token list, released only once its UTF-8 is complete.

    Decodes a short window (from the last complete cut) instead of the whole list each step,
    in one call to the tokenizer's own incremental decoder where it has one (`text_stream`:
    the same window rule, in Rust; two `decode` calls a token were 18% of the server's engine
    thread at 64 streams).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # end of what has been released
        text_stream = getattr(tokenizer, "text_stream", None)
        self._stream = text_stream() if text_stream is not None else None

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self._stream is not None:
            text = self._stream(token)
            if text is None:
                return ""
            self.prefix, self.read = self.read, len(self.ids)  # for `flush`
            return text
        prefix_text = self.tokenizer.decode(self.ids[self.prefix : self.read])
        new_text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """What is left (incomplete bytes become U+FFFD)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix : self.read])
        new_text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text) :]


@dataclass(eq=False)  # compared by identity
class Sequence:
    """One prompt's continuation, from the waiting queue to its last token."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # params' limit, cut to what fits in the cache
    stop_ids: frozenset[int]
    text_decoder: IncrementalText | None
    num_logprobs: int | None = None  # None: none; k: the chosen token's and the k best
    # A sequence with the same prompt whose cached prompt this one copies rather than
    # prefilling it (several completions of one prompt: `Engine.sequence(shares_prompt_with=)`)
    prompt_source: Sequence | None = None
    generator: torch.Generator | None = None  # its own draws, from its seed (`_draw_ahead`)
    # Its params' json_format as an xgrammar.GrammarMatcher: the tokens allowed next; the
    # engine feeds it each token before the token is pushed (`Engine._feed_grammars`)
    grammar: Any = None
    adapter_slot: int = 0  # its LoRA adapter's slot in the engine (0: the base model)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_emitted: int = 0  # characters of `text` already streamed
    finish_reason: str | None = None
    stop: int | str | None = None
    # Engine state: the cache row while it runs, how much of the prompt is in it, the tokens
    # launched (some may not have reached the host yet) and their log-probabilities.
    slot: int | None = None
    admitted_at: int = 0  # the engine's decode step count when it got its row
    num_cached: int = 0
    cached_tokens: int = 0  # prompt tokens copied from the prefix cache, not prefilled
    num_scheduled: int = 0
    cancelled: bool = False
    # per launched token: (HostValues, its index there, top or None): the chosen token's
    # log-probability and the k best
    logprobs: deque = field(default_factory=deque)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def done(self) -> bool:
        """Finished or cancelled: nothing more will be produced."""
        return self.finished or self.cancelled

    @property
    def plain_greedy(self) -> bool:
        """Whether its next token is its logits' argmax and nothing else reads them (no draws
        of its own, no log-probabilities, no stop ids masked by min_tokens, no grammar)."""
        return (
            self.params.greedy
            and self.generator is None
            and self.num_logprobs is None
            and not self.under_min_tokens
            and self.grammar is None
        )

    @property
    def under_min_tokens(self) -> bool:
        """Whether its next token (the one the engine launches next) may not be a stop token:
        fewer than min_tokens are launched, and it has stop ids."""
        return self.num_scheduled < self.params.min_tokens and bool(self.stop_ids)

    @property
    def prefilled(self) -> bool:
        return self.num_cached == len(self.prompt_ids)

    @property
    def decode_position(self) -> int:
        """The position (cache slot) of the token its next decode step feeds: the last one
        launched (the prompt's first token is launched by the prefill), known on the host
        before that token has reached it."""
        return len(self.prompt_ids) + self.num_scheduled - 1

    def push(self, token: int) -> TokenEvent:
        """Take one generated token; check stops; return what to stream. (The server calls
        this for every token of every stream: at 64 streams it was half of the engine thread,
        hence the locals and the stop-string work only where there are stop strings.)"""
        token_ids = self.token_ids
        token_ids.append(token)
        is_stop_token = token in self.stop_ids
        at_length = len(token_ids) >= self.max_new_tokens
        # a grammar without stop ids to await ends with the JSON's last token
        json_done = self.grammar is not None and not is_stop_token and self.grammar.is_terminated()
        stops = self.params.stop
        text = self.text
        if self.text_decoder is not None:
            old_length = len(text)
            if not is_stop_token:
                text += self.text_decoder.push(token)
            if is_stop_token or at_length or json_done:
                text += self.text_decoder.flush()  # bytes of an incomplete character
            self.text = text
            if stops and len(token_ids) > self.params.min_tokens:  # (vLLM's rule)
                self._check_stop_strings(old_length)
                text = self.text
        if self.finish_reason is None:
            if is_stop_token:
                self.finish_reason, self.stop = "stop", token
            elif json_done:
                self.finish_reason = "stop"
            elif at_length:
                self.finish_reason = "length"
        finished = self.finish_reason is not None
        final = len(text) - self._held_back() if stops and not finished else len(text)
        emitted = self.num_emitted
        if final > emitted:
            delta, self.num_emitted = text[emitted:final], final
        else:
            delta = ""
        return TokenEvent(
            self.index,
            token,
            delta,
            self.finish_reason,
            is_stop_token=self.finish_reason == "stop" and self.stop == token,
        )

    def _check_stop_strings(self, old_length: int) -> None:
        if not self.params.stop:
            return
        # A stop string found now must end in the new text.
        start = max(0, old_length - max(map(len, self.params.stop)) + 1)
        found = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            cut, string = min(found)
            self.text = self.text[:cut]
            self.finish_reason, self.stop = "stop", string

    def _held_back(self) -> int:
        """Length of the longest end of the text that could begin a stop string."""
        longest = 0
        for string in self.params.stop:
            for length in range(min(len(string) - 1, len(self.text)), longest, -1):
                if self.text.endswith(string[:length]):
                    longest = length
                    break
        return longest

    def result(self) -> GenerationResult:
        return GenerationResult(
            index=self.index,
            prompt_ids=self.prompt_ids,
            token_ids=self.token_ids,
            text=self.text,
            finish_reason=self.finish_reason or "length",
            stop=self.stop,
        )
