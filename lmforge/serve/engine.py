"""The server's side of the inference engine: requests in, token streams out, on asyncio.

`Engine` wraps the generator's `lmforge.generate.Engine` (continuous batching over one KV cache
of `max_batch` rows; see lmforge/generate/engine.py) and runs its steps one after another in an
engine thread of its own while there is work, so the event loop serves HTTP meanwhile: the
thread posts each step's tokens to the loop (`call_soon_threadsafe`), which hands them to their
requests' queues, and starts the next step without waiting for the loop (a round trip through
the loop for every step put the loop's turn and two thread hand-offs between consecutive steps).
Only the thread touches the core engine while it runs: the loop records changes (adding
sequences, cancelling them) as ops, which the thread applies at the start of its next step.

Under tensor parallelism (`lmforge launch --nproc N serve`) rank 0 serves HTTP and every other
process replays its engine: the loop records each change to the core engine as an op (add,
cancel, clear), and before each step `mirror` sends that step's ops to the other processes, which
apply them and step too (`follow`); when idle it sends a heartbeat now and then, and a stop at
shutdown. Ops are applied at the start of a step on every process alike, so all hold the same
sequences in the same rows and run the same collectives, with the same shapes: a decode step's
batch and KV lengths follow from that host state (rows, prompt lengths, tokens launched), which
the ops and the all-gathered logits keep equal everywhere, so they need not be sent.

A request with n choices is one `Submission` of n sequences. Up to `max_batch` sequences run
and `max_queue` more wait; beyond that `submit` raises `QueueFull` (HTTP 429). A sequence's
greedy output does not depend on what runs beside it, and a seeded one draws the same tokens
(the core engine gives each its own `torch.Generator`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
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
    """The sequences of one request; iterate `events()` for their `TokenOutput`s, which come
    in batches: one step's, or under load a few steps' (see `Engine`'s stream_interval)."""

    engine: Engine
    sequences: list[EngineSequence] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # of lists of outputs
    cancelled: bool = False
    cancel_reason: str = "cancelled"
    pending: list[TokenOutput] = field(default_factory=list)  # not yet in the queue
    delivered: bool = False  # whether anything went into the queue yet

    async def events(self, *, deadline: float | None = None) -> AsyncIterator[list[TokenOutput]]:
        """Every sequence's outputs as they come, in batches, until each has finished (the
        last output of each has a `finish_reason`). Raises TimeoutError at `deadline` (the
        event loop's `time()`); the caller then cancels."""
        loop = asyncio.get_running_loop()
        remaining = len(self.sequences)
        while remaining:
            if deadline is None:
                batch: list[TokenOutput] = await self.queue.get()
            else:
                batch = await asyncio.wait_for(self.queue.get(), deadline - loop.time())
            remaining -= sum(output.finish_reason is not None for output in batch)
            yield batch

    def deliver(self, *, every_step: bool, last: TokenOutput | None = None) -> None:
        """Put the pending outputs (and `last`) in the queue: now if `every_step`, if nothing
        was delivered yet (the first token is not held back), or if one of them ends a
        sequence; otherwise they wait for a later step."""
        if last is not None:
            self.pending.append(last)
        finishes = any(output.finish_reason is not None for output in self.pending)
        if self.pending and (every_step or not self.delivered or finishes):
            self.queue.put_nowait(self.pending)
            self.pending, self.delivered = [], True

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop generating (a client that left, a timeout); frees the rows at the next step.
        A no-op once everything has finished."""
        if not self.cancelled and not all(s.done for s in self.sequences):
            self.cancelled = True
            self.cancel_reason = reason
            for sequence in self.sequences:
                self.engine._finish(sequence, reason, notify=False)


class Engine:
    """The core engine of `generator`, driven from asyncio (see the module docstring).

    Args:
        generator: its engine's `max_batch` is the number of sequences that run at once.
        max_queue: sequences that may wait for a free row beyond those.
        mirror: under tensor parallelism, on rank 0: sends (ops, action) to the other
            processes (see the module docstring).
        on_finish: called on the event loop as `on_finish(reason, num_new_tokens)` when a
            sequence leaves ("stop", "length", "error" or a cancel reason), for metrics.
        on_step: called on the event loop as `on_step(num_advanced, seconds)` after each step:
            the sequences it advanced and the seconds the worker thread spent in it.
        stream_interval: steps between deliveries of a running sequence's tokens to its
            request (a sequence's first and last tokens go at once). None: one step per
            RUNNING_PER_STREAM_INTERVAL running sequences (every step below 16, every 8th at
            64): with many streams the server is bound by Python work per event (HTTP
            writes, JSON), and one event of a few tokens costs about what one token's did.
    """

    def __init__(
        self,
        generator: Generator,
        *,
        max_queue: int,
        on_finish: Callable[[str, int], None] | None = None,
        on_step: Callable[[int, float], None] | None = None,
        mirror: Callable[[list[tuple], str], None] | None = None,
        stream_interval: int | None = None,
    ) -> None:
        if generator.tokenizer is None:
            raise ValueError("the serving engine needs a generator with a tokenizer")
        self.generator = generator
        self.core = generator.engine
        self.mirror = mirror  # rank 0 under tensor parallelism: (ops, action) to the others
        self._ops: list[tuple] = []  # changes for the next step (taken under _ops_lock)
        self._ops_lock = threading.Lock()
        self._keys: dict[EngineSequence, int] = {}  # event loop side
        self._sequences: dict[int, EngineSequence] = {}  # engine thread side
        self._next_key = 0
        self.max_concurrency = generator.max_batch
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.on_step = on_step
        self.stream_interval = stream_interval
        self._submissions: dict[EngineSequence, Submission] = {}  # every sequence not done
        self._wake = threading.Event()  # set when ops are added or the engine stops
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_steps = 0

    # ---- state ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting + sum(op[0] == "add" for op in self._ops)

    @property
    def capacity(self) -> int:
        """Sequences the engine holds at most (running + waiting)."""
        return self.max_concurrency + self.max_queue

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        if self.running:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lmforge-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread (a step under way ends first); sequences still there finish
        with "error"."""
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self.mirror is not None:
            self.mirror([], "stop")
            self.mirror = None
        self._clear_core()
        self._fail_all()

    def _fail_all(self) -> None:
        """End every sequence with "error", on the event loop: ops not applied yet go with
        them, and sequences already in the core are cancelled at the engine's next step (the
        core is cleared by the engine thread after a failed step, by `stop` at the end)."""
        self._take_ops()
        for sequence in list(self._submissions):
            self._finish(sequence, "error", notify=True)

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
        ops = []
        for choice, request in enumerate(requests):
            seed = request.seed
            if seed is None and self.mirror is not None and not request.params.greedy:
                seed = random.randrange(2**62)  # every process must draw the same tokens
            ids = list(request.prompt_ids)
            sequence = self.core.sequence(
                ids, request.params, index=choice, seed=seed, num_logprobs=request.num_logprobs
            )
            submission.sequences.append(sequence)
            key, self._next_key = self._next_key, self._next_key + 1
            ops.append(("add", key, ids, request.params, choice, seed, request.num_logprobs))
            ops[-1] += (sequence,)  # this process's own object (not sent)
        for sequence, op in zip(submission.sequences, ops):
            self._submissions[sequence] = submission
            self._keys[sequence] = op[1]
        self._add_ops(ops)
        return submission

    def _add_ops(self, ops: list[tuple]) -> None:
        with self._ops_lock:
            self._ops += ops
        self._wake.set()

    def _take_ops(self) -> list[tuple]:
        with self._ops_lock:
            ops, self._ops = self._ops, []
        return ops

    # ---- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread: step while there is work, post each step's tokens to the event
        loop, sleep on `_wake` otherwise (under tensor parallelism with a heartbeat to the
        other processes, which wait in a collective that must not time out)."""
        while not self._stopping:
            self._wake.clear()  # before looking: ops added from here on set it again
            ops = self._take_ops()
            if not ops and not self.core.has_work:
                woken = self._wake.wait(HEARTBEAT_S if self.mirror is not None else None)
                if not woken and self.mirror is not None:
                    self.mirror([], "wait")
                continue
            started = time.perf_counter()
            try:
                events = self._step(ops)
            except Exception as err:
                self._clear_core()
                self._loop.call_soon_threadsafe(self._step_failed, err)
                if self.mirror is not None:
                    return  # the processes are out of step: nothing to keep serving with
                continue
            self._loop.call_soon_threadsafe(self._dispatch, events, time.perf_counter() - started)

    def _clear_core(self) -> None:
        """Drop every sequence from the core (the engine thread's side, or after it ended)."""
        self.core.clear()
        self._sequences.clear()

    def _step_failed(self, err: Exception) -> None:
        """A bug, not the client's doing: fail what ran, keep serving (one process)."""
        logger.error("generation step failed", exc_info=err)
        self._fail_all()

    def _dispatch(self, events: list, seconds: float) -> None:
        """On the event loop: one step's tokens to their requests."""
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(len(events), seconds)
        touched: dict[int, Submission] = {}
        for sequence, event in events:
            submission = self._submissions.get(sequence)
            if submission is None or submission.cancelled:
                continue
            submission.pending.append(_output(event))
            touched[id(submission)] = submission
            if event.finish_reason is not None:
                self._finish(sequence, event.finish_reason, notify=False)
        every_step = self.num_steps % self._stream_interval() == 0
        for submission in touched.values():
            submission.deliver(every_step=every_step)

    def _stream_interval(self) -> int:
        """Steps between deliveries of a running sequence's tokens to its request."""
        if self.stream_interval is not None:
            return self.stream_interval
        return max(1, self.core.num_running // RUNNING_PER_STREAM_INTERVAL)

    def _step(self, ops: list[tuple]) -> list:
        """One step in the engine thread: the ops (sent to the other processes first), then
        the core engine's step."""
        if self.mirror is not None:
            self.mirror([op[:-1] if op[0] == "add" else op for op in ops], "step")
        events = apply_ops(self.core, ops, self._sequences)
        return events

    def shut_down_sessions(self, reason: str = "shutdown") -> None:
        """End every sequence now (the drain's grace period ran out): each submission gets a
        last output with `finish_reason = reason` and its rows are freed at the next step."""
        for sequence, submission in list(self._submissions.items()):
            if not submission.cancelled:
                submission.cancel(reason)
                last = TokenOutput(sequence.index, -1, "", reason)
                submission.deliver(every_step=True, last=last)

    def _finish(self, sequence: EngineSequence, reason: str, *, notify: bool) -> None:
        """Take a sequence out (its row is free for the next step)."""
        submission = self._submissions.pop(sequence, None)
        if submission is None:
            return
        key = self._keys.pop(sequence)
        if not sequence.finished:  # cancelled: its row is freed at the next step
            self._add_ops([("cancel", key)])
        if notify:
            submission.deliver(every_step=True, last=TokenOutput(sequence.index, -1, "", reason))
        if self.on_finish is not None:
            self.on_finish(reason, len(sequence.token_ids))


# Under load, tokens reach their requests every few steps (see `Engine`'s stream_interval):
# one step more between deliveries for every this many running sequences.
RUNNING_PER_STREAM_INTERVAL = 8

HEARTBEAT_S = 60.0  # idle rank 0 tells the other processes it is alive this often


def apply_ops(core, ops: list[tuple], sequences: dict[int, EngineSequence]) -> list:
    """Apply a step's ops to `core` and run the step; `sequences` maps op keys to this
    process's sequences (rank 0 passes its own objects in "add" ops, others build them)."""
    for op in ops:
        if op[0] == "add":
            key, ids, params, index, seed, num_logprobs = op[1:7]
            sequence = op[7] if len(op) > 7 else None
            if sequence is None:
                sequence = core.sequence(
                    ids, params, index=index, seed=seed, num_logprobs=num_logprobs
                )
            sequences[key] = sequence
            core.add([sequence])
        elif op[0] == "cancel" and op[1] in sequences:
            core.cancel(sequences.pop(op[1]))
    events = core.step()
    for key in [key for key, sequence in sequences.items() if sequence.done]:
        del sequences[key]
    return events


def follow(core, receive: Callable[[], tuple[list[tuple], str]]) -> None:
    """A process other than rank 0 under tensor parallelism: replay rank 0's ops and steps
    (`receive()` returns each (ops, action) that rank 0's `mirror` sent) until it stops."""
    sequences: dict[int, EngineSequence] = {}
    while True:
        ops, action = receive()
        if action == "stop":
            return
        if action == "step":
            apply_ops(core, ops, sequences)


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
