"""Continuous batching over the `Generator`: sequences join and leave a running batch.

The `Engine` owns one `Generator` (its KV cache has `max_batch` rows, one per running sequence)
and one background asyncio task. Each turn of that task is one *step*, run in a worker thread so
the event loop keeps serving HTTP meanwhile:

1. decode: one `Generator.decode` over all cache rows; every running sequence feeds its last
   token at its own position (row r's token at position p writes slot p of row r), idle rows
   feed a dummy token at position 0. The shapes never change, so a row's logits do not depend
   on which other rows are busy or what they hold: a sequence's greedy output is the same
   alone or beside 31 others.
2. join: waiting sequences take free rows; each is prefilled on its own into its row
   (`Generator.prefill(..., rows=[row])`) and samples its first token. Joining after the
   decode matters: the decode writes slot 0 of idle rows.

Between steps (on the event loop) finished and cancelled sequences leave, freeing their rows,
and new ones are admitted up to `max_concurrency` running plus `max_queue` waiting; beyond
that `submit` raises `QueueFull` (HTTP 429). Stops, stop strings and the text of each token are
the Generator's own (`_Row`); sampling uses its `Sampler`, one per sequence with the
sequence's own `torch.Generator`, so a seeded request draws the same tokens whatever else runs.
Orca (Yu et al., OSDI 2022) calls this iteration-level scheduling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from lmforge.generate import Generator, Sampler, SamplingParams
from lmforge.generate.generate import _Row

logger = logging.getLogger("lmforge.serve")


class QueueFull(Exception):
    """No room for more sequences: `max_concurrency` run and `max_queue` wait already."""


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate (a request with n choices asks for n of them).

    Args:
        prompt_ids: the prompt's token ids (non-empty, shorter than the cache).
        params: sampling settings, length limit and stops.
        seed: seeds this sequence's sampling (None: random).
        num_logprobs: None for no log-probabilities; k >= 0 for the chosen token's and the k
            most likely tokens' log-probabilities at each step.
    """

    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None = None
    num_logprobs: int | None = None


@dataclass
class TokenOutput:
    """One step's result for one sequence."""

    choice: int  # which sequence of the submission
    token_id: int
    text: str  # text that became final with this token (may be "")
    finish_reason: str | None = None  # "stop", "length" or "error" on the last one
    logprob: float | None = None  # of the chosen token
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    is_stop_token: bool = False  # the token ended the sequence and is not part of the text


@dataclass(eq=False)  # compared by identity
class _Sequence:
    choice: int
    submission: Submission
    request: SequenceRequest
    row: _Row
    sampler: Sampler | None  # None: greedy (argmax)
    generator: torch.Generator | None
    slot: int | None = None  # cache row while running
    done: bool = False

    @property
    def position(self) -> int:
        """Position of the last sampled token, which the next decode feeds."""
        return len(self.row.prompt_ids) + len(self.row.token_ids) - 1


@dataclass(eq=False)
class Submission:
    """The sequences of one request; iterate `events()` for their `TokenOutput`s."""

    engine: Engine
    sequences: list[_Sequence] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    cancel_reason: str = "cancelled"

    async def events(self, *, deadline: float | None = None) -> AsyncIterator[TokenOutput]:
        """Every sequence's outputs as they come, until each has finished (the last output of
        each has a `finish_reason`). Raises TimeoutError at `deadline` (the event loop's
        `time()`); the caller then cancels."""
        loop = asyncio.get_running_loop()
        remaining = len(self.sequences)
        while remaining:
            if deadline is None:
                output: TokenOutput = await self.queue.get()
            else:
                output = await asyncio.wait_for(self.queue.get(), deadline - loop.time())
            if output.finish_reason is not None:
                remaining -= 1
            yield output

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop generating (a client that left, a timeout); frees the rows at the next step.
        A no-op once everything has finished."""
        if not self.cancelled and not all(s.done for s in self.sequences):
            self.cancelled = True
            self.cancel_reason = reason
            self.engine._wake.set()


class Engine:
    """Continuous batching over one `Generator` (see the module docstring).

    Args:
        generator: its `max_batch` is the number of sequences that run at once.
        max_queue: sequences that may wait for a free row beyond those.
        on_finish: called on the event loop as `on_finish(reason, num_new_tokens)` when a
            sequence leaves ("stop", "length", "error" or a cancel reason), for metrics.
        on_step: called on the event loop with the number of sequences each step advanced.
    """

    def __init__(
        self,
        generator: Generator,
        *,
        max_queue: int,
        on_finish: Callable[[str, int], None] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        if generator.tokenizer is None:
            raise ValueError("the serving engine needs a generator with a tokenizer")
        self.generator = generator
        self.max_concurrency = generator.max_batch
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.on_step = on_step
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}  # cache row -> sequence
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stop_ids = generator._default_stop_ids()
        self.num_steps = 0

    # ---- state ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def capacity(self) -> int:
        """Sequences the engine holds at most (running + waiting)."""
        return self.max_concurrency + self.max_queue

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.running:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-engine")
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="lmforge-engine")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("the engine loop failed", exc_info=task.exception())
            for sequence in [*self._waiting, *self._running.values()]:
                self._finish(sequence, "error", notify=True)

    async def stop(self) -> None:
        """Cancel the loop; sequences still there finish with "error"."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sequence in [*self._waiting, *self._running.values()]:
            self._finish(sequence, "error", notify=True)
        self._waiting.clear()
        self._running.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---- submitting -----------------------------------------------------------------------

    def submit(self, requests: Sequence[SequenceRequest]) -> Submission:
        """Queue sequences (all or none); raises `QueueFull` when they do not fit."""
        if not self.running:
            raise RuntimeError("the engine is not running")
        held = len(self._waiting) + len(self._running)
        if held + len(requests) > self.capacity:
            raise QueueFull(
                f"{held} sequences are running or waiting; at most {self.capacity} "
                f"(max_concurrency {self.max_concurrency} + max_queue {self.max_queue})"
            )
        submission = Submission(self)
        for choice, request in enumerate(requests):
            row = self.generator._make_row(choice, list(request.prompt_ids), request.params)
            sampler = generator = None
            if not request.params.greedy:
                sampler = Sampler([request.params], device=self.generator.device)
                generator = torch.Generator(device=self.generator.device)
                if request.seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(request.seed % 2**64)
            sequence = _Sequence(choice, submission, request, row, sampler, generator)
            submission.sequences.append(sequence)
            self._waiting.append(sequence)
        self._wake.set()
        return submission

    # ---- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            joining = []
            free = (r for r in range(self.max_concurrency) if r not in self._running)
            for slot in free:
                if not self._waiting:
                    break
                sequence = self._waiting.popleft()
                sequence.slot = slot
                self._running[slot] = sequence
                joining.append(sequence)
            decoding = [s for s in self._running.values() if s not in joining]
            try:
                outputs = await loop.run_in_executor(self._executor, self._step, decoding, joining)
            except Exception:
                # A bug, not the client's doing: fail the sequences of this step, keep serving.
                logger.exception("generation step failed")
                for sequence in decoding + joining:
                    self._finish(sequence, "error", notify=True)
                continue
            self.num_steps += 1
            if self.on_step is not None:
                self.on_step(len(outputs))
            for sequence, output in outputs:
                if sequence.submission.cancelled:
                    continue
                sequence.submission.queue.put_nowait(output)
                if output.finish_reason is not None:
                    self._finish(sequence, output.finish_reason, notify=False)

    def shut_down_sessions(self, reason: str = "shutdown") -> None:
        """End every sequence now (the drain's grace period ran out): each submission gets a
        last output with `finish_reason = reason` and its rows are freed at the next step."""
        for sequence in [*self._waiting, *self._running.values()]:
            if not sequence.submission.cancelled:
                sequence.submission.cancel(reason)
                sequence.submission.queue.put_nowait(TokenOutput(sequence.choice, -1, "", reason))

    def _drop_cancelled(self) -> None:
        for sequence in [*self._waiting, *self._running.values()]:
            if sequence.submission.cancelled:
                self._finish(sequence, sequence.submission.cancel_reason, notify=False)

    def _finish(self, sequence: _Sequence, reason: str, *, notify: bool) -> None:
        """Take a sequence out (its row is free for the next step)."""
        if sequence.done:
            return
        sequence.done = True
        if sequence.slot is not None and self._running.get(sequence.slot) is sequence:
            del self._running[sequence.slot]
        if sequence.slot is None:
            self._waiting.remove(sequence)
        if notify:
            sequence.submission.queue.put_nowait(TokenOutput(sequence.choice, -1, "", reason))
        if self.on_finish is not None:
            self.on_finish(reason, len(sequence.row.token_ids))

    # ---- one step (in the worker thread) --------------------------------------------------

    def _step(
        self, decoding: list[_Sequence], joining: list[_Sequence]
    ) -> list[tuple[_Sequence, TokenOutput]]:
        generator, outputs = self.generator, []
        if decoding:
            tokens = torch.zeros(generator.max_batch, dtype=torch.long)
            positions = torch.zeros(generator.max_batch, dtype=torch.long)
            for sequence in decoding:
                tokens[sequence.slot] = sequence.row.token_ids[-1]
                positions[sequence.slot] = sequence.position
            logits = generator.decode(
                tokens.to(generator.device), positions.to(generator.device)
            )  # [max_batch, vocab]
            slots = torch.tensor([s.slot for s in decoding], device=generator.device)
            outputs += self._sample(decoding, logits[slots])
        for sequence in joining:
            logits = generator.prefill([sequence.row.prompt_ids], rows=[sequence.slot])
            outputs += self._sample([sequence], logits)
        return outputs

    def _sample(
        self, sequences: list[_Sequence], logits: torch.Tensor
    ) -> list[tuple[_Sequence, TokenOutput]]:
        """logits [len(sequences), vocab] -> each sequence's next token, pushed to its row."""
        chosen = logits.argmax(dim=-1)  # greedy rows; sampled rows are replaced below
        for index, sequence in enumerate(sequences):
            if sequence.sampler is not None:
                chosen[index] = sequence.sampler(logits[index : index + 1], sequence.generator)[0]
        want_logprobs = [s.request.num_logprobs is not None for s in sequences]
        logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None
        outputs = []
        for index, (sequence, token) in enumerate(zip(sequences, chosen.tolist())):
            event = sequence.row.push(token)
            output = TokenOutput(
                choice=sequence.choice,
                token_id=token,
                text=event.text,
                finish_reason=event.finish_reason,
                is_stop_token=event.finish_reason == "stop" and sequence.row.stop == token,
            )
            if logprobs is not None and want_logprobs[index]:
                row = logprobs[index]
                output.logprob = _finite(row[token].item())
                k = sequence.request.num_logprobs
                if k:
                    values, ids = row.topk(min(k, row.shape[-1]))
                    output.top_logprobs = [
                        (i, _finite(v)) for i, v in zip(ids.tolist(), values.tolist())
                    ]
            outputs.append((sequence, output))
        return outputs


def _finite(value: float) -> float:
    """JSON has no -inf: a probability of zero becomes the lowest float."""
    return value if math.isfinite(value) else -3.4e38
