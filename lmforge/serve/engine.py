"""The server's side of the inference engine: requests in, token streams out, on asyncio.

`Engine` wraps the generator's `lmforge.generate.Engine` (continuous batching over one KV cache
of `max_batch` rows; see lmforge/generate/engine.py) and runs its steps in a background asyncio
task: each `step()` runs in a worker thread, so the event loop keeps serving HTTP meanwhile, and
the tokens it returns go to their requests' queues. Everything that changes the core engine
(adding sequences, cancelling them) happens on the event loop between steps.

A request with n choices is one `Submission` of n sequences. Up to `max_batch` sequences run
and `max_queue` more wait; beyond that `submit` raises `QueueFull` (HTTP 429). A sequence's
greedy output does not depend on what runs beside it, and a seeded one draws the same tokens
(the core engine gives each its own `torch.Generator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lmforge.generate import Generator, SamplingParams, TokenEvent
from lmforge.generate import Sequence as EngineSequence

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


@dataclass(eq=False)
class Submission:
    """The sequences of one request; iterate `events()` for their `TokenOutput`s."""

    engine: Engine
    sequences: list[EngineSequence] = field(default_factory=list)
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
    """The core engine of `generator`, driven from asyncio (see the module docstring).

    Args:
        generator: its engine's `max_batch` is the number of sequences that run at once.
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
        self.core = generator.engine
        self.max_concurrency = generator.max_batch
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.on_step = on_step
        self._submissions: dict[EngineSequence, Submission] = {}  # every sequence not done
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.num_steps = 0

    # ---- state ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

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
            self._fail_all()

    async def stop(self) -> None:
        """Cancel the loop; sequences still there finish with "error"."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._executor is not None:  # a step still running in it ends first
            self._executor.shutdown(wait=True)
            self._executor = None
        self._fail_all()

    def _fail_all(self) -> None:
        for sequence in list(self._submissions):
            self._finish(sequence, "error", notify=True)
        self.core.clear()

    # ---- submitting -----------------------------------------------------------------------

    def submit(self, requests: Sequence[SequenceRequest]) -> Submission:
        """Queue sequences (all or none); raises `QueueFull` when they do not fit."""
        if not self.running:
            raise RuntimeError("the engine is not running")
        held = len(self._submissions)
        if held + len(requests) > self.capacity:
            raise QueueFull(
                f"{held} sequences are running or waiting; at most {self.capacity} "
                f"(max_concurrency {self.max_concurrency} + max_queue {self.max_queue})"
            )
        submission = Submission(self)
        for choice, request in enumerate(requests):
            sequence = self.core.sequence(
                list(request.prompt_ids),
                request.params,
                index=choice,
                seed=request.seed,
                num_logprobs=request.num_logprobs,
            )
            submission.sequences.append(sequence)
        for sequence in submission.sequences:
            self._submissions[sequence] = submission
        self.core.add(submission.sequences)
        self._wake.set()
        return submission

    # ---- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if not self.core.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                events = await loop.run_in_executor(self._executor, self.core.step)
            except Exception:
                # A bug, not the client's doing: fail what runs now, keep serving.
                logger.exception("generation step failed")
                self._fail_all()
                continue
            self.num_steps += 1
            if self.on_step is not None:
                self.on_step(len(events))
            for sequence, event in events:
                submission = self._submissions.get(sequence)
                if submission is None or submission.cancelled:
                    continue
                submission.queue.put_nowait(_output(event))
                if event.finish_reason is not None:
                    self._finish(sequence, event.finish_reason, notify=False)

    def shut_down_sessions(self, reason: str = "shutdown") -> None:
        """End every sequence now (the drain's grace period ran out): each submission gets a
        last output with `finish_reason = reason` and its rows are freed at the next step."""
        for sequence, submission in list(self._submissions.items()):
            if not submission.cancelled:
                submission.cancel(reason)
                submission.queue.put_nowait(TokenOutput(sequence.index, -1, "", reason))

    def _drop_cancelled(self) -> None:
        for sequence, submission in list(self._submissions.items()):
            if submission.cancelled:
                self._finish(sequence, submission.cancel_reason, notify=False)

    def _finish(self, sequence: EngineSequence, reason: str, *, notify: bool) -> None:
        """Take a sequence out (its row is free for the next step)."""
        submission = self._submissions.pop(sequence, None)
        if submission is None:
            return
        self.core.cancel(sequence)  # a no-op for a sequence that finished
        if notify:
            submission.queue.put_nowait(TokenOutput(sequence.index, -1, "", reason))
        if self.on_finish is not None:
            self.on_finish(reason, len(sequence.token_ids))


def _output(event: TokenEvent) -> TokenOutput:
    top = event.top_logprobs
    return TokenOutput(
        choice=event.index,
        token_id=event.token_id,
        text=event.text,
        finish_reason=event.finish_reason,
        logprob=None if event.logprob is None else _finite(event.logprob),
        top_logprobs=None if top is None else [(i, _finite(v)) for i, v in top],
        is_stop_token=event.is_stop_token,
    )


def _finite(value: float) -> float:
    """JSON has no -inf: a probability of zero becomes the lowest float."""
    return value if math.isfinite(value) else -3.4e38
