"""The server's side of the inference engine: requests in, token streams out, on asyncio.

Two halves that share nothing but messages, so that they can run in two processes:
- the engine loop (`run_engine`) owns the core engine (`lmforge.generate.Engine`: continuous
  batching over one KV cache of `max_batch` rows) and steps it while there is work: before each
  step it takes the ops that arrived (add a sequence, cancel one), after it posts the step's
  tokens as plain tuples, and starts the next step without waiting for anyone;
- the front end (`Engine`) lives on the event loop: it turns requests into ops, keeps each
  request's `Submission`, and hands the posted tokens to their requests.

A channel carries the messages. `ThreadChannel` runs the loop in a thread of the event loop's
process (the library's way; tests). `lmforge serve` runs HTTP in a process of its own
(serve/frontend.py: `PipeChannel`), the engine loop in the main process: on one interpreter
the event loop and the engine thread took turns on one GIL, and at 64 streams that, not the
GPU, set the pace.

Under tensor parallelism (`lmforge launch --nproc N serve`) rank 0 runs the engine loop and
every other process replays it: before each step `mirror` sends that step's ops to the other
processes, which apply them and step too (`follow`); when idle it sends a heartbeat now and
then, and a stop at the end. Ops are applied at the start of a step on every process alike, so
all hold the same sequences in the same rows and run the same collectives, with the same
shapes: a decode step's batch and KV lengths follow from that host state (rows, prompt lengths,
tokens launched), which the ops and the all-gathered logits keep equal everywhere. Sampled
sequences without a seed draw from the core engine's generator, seeded alike on every process
(`lmforge serve` does it), so every process draws the same tokens.

A request with n choices is one `Submission` of n sequences. Up to `max_concurrency` sequences
run and `max_queue` more wait; beyond that `submit` raises `QueueFull` (HTTP 429). A sequence's
greedy output does not depend on what runs beside it, and a seeded one draws the same tokens
(the core engine gives each its own `torch.Generator`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from lmforge.errors import ConfigError, ModelFormatError
from lmforge.generate import SamplingParams
from lmforge.generate import Sequence as EngineSequence

logger = logging.getLogger("lmforge.serve")


class QueueFull(Exception):
    """No room for more sequences: `max_concurrency` run and `max_queue` wait already."""


class EngineStopped(Exception):
    """The engine loop is not running (stopped, or ended by a failure it cannot serve past)."""


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
    adapter: str | None = None  # a loaded LoRA adapter's name (None: the base model)


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


@dataclass(eq=False, slots=True)
class Stream:
    """The front end's view of one sequence (the engine loop holds the sequence itself)."""

    key: int  # names the sequence in ops and posted tokens
    choice: int
    submission: Submission
    num_tokens: int = 0  # received so far (a final stop token included)
    cached_tokens: int = 0  # prompt tokens the prefix cache served (known at the first token)
    finish_reason: str | None = None
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.cancelled


@dataclass(eq=False)
class Submission:
    """The sequences of one request; iterate `events()` for their `TokenOutput`s, which come
    in batches: one step's, or under load a few steps' (see `Engine`'s stream_interval)."""

    engine: Engine
    sequences: list[Stream] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # of lists of outputs
    cancelled: bool = False
    cancel_reason: str = "cancelled"
    pending: list[TokenOutput] = field(default_factory=list)  # not yet in the queue
    delivered: bool = False  # whether anything went into the queue yet

    @property
    def num_tokens(self) -> int:
        return sum(stream.num_tokens for stream in self.sequences)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens its sequences took from the prefix cache rather than prefilling."""
        return sum(stream.cached_tokens for stream in self.sequences)

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
            for stream in self.sequences:
                self.engine._finish(stream, reason, notify=False)


class Engine:
    """The front end: requests to ops, posted tokens to requests (see the module docstring).

    Args:
        channel: carries ops to the engine loop and its messages back (`ThreadChannel`, or
            serve/frontend.py's `PipeChannel`).
        max_concurrency: sequences that run at once (the core engine's max_batch).
        max_queue: sequences that may wait for a free row beyond those.
        on_finish: called on the event loop as `on_finish(reason, num_new_tokens)` when a
            sequence leaves ("stop", "length", "error" or a cancel reason), for metrics.
        on_step: called on the event loop as `on_step(num_advanced, seconds)` after each step:
            the sequences it advanced and the seconds the engine loop spent in it.
        on_first_token: called on the event loop as `on_first_token(cached_tokens)` when a
            sequence's first token arrives: its prompt tokens the prefix cache served.
        stream_interval: steps between deliveries of a running sequence's tokens to its
            request (a sequence's first and last tokens go at once). None: one step per
            RUNNING_PER_STREAM_INTERVAL running sequences (every step below 16, every 8th at
            64): with many streams the server is bound by Python work per event (HTTP
            writes, JSON), and one event of a few tokens costs about what one token's did.
    """

    def __init__(
        self,
        channel,
        *,
        max_concurrency: int,
        max_queue: int,
        on_finish: Callable[[str, int], None] | None = None,
        on_step: Callable[[int, float], None] | None = None,
        on_first_token: Callable[[int], None] | None = None,
        stream_interval: int | None = None,
    ) -> None:
        self.channel = channel
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.on_step = on_step
        self.on_first_token = on_first_token
        self.stream_interval = stream_interval
        self._streams: dict[int, Stream] = {}  # every sequence not done, by key
        self._num_waiting = 0  # of those, the ones without a token yet
        self._next_key = 0
        self._started = False
        self.num_steps = 0
        self._adapter_ops: dict[int, asyncio.Future] = {}  # op id -> its answer, awaited

    # ---- state ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._streams) - self._num_waiting

    @property
    def num_waiting(self) -> int:
        """Sequences without a first token yet (queued, or in their prefill)."""
        return self._num_waiting

    @property
    def capacity(self) -> int:
        """Sequences the engine holds at most (running + waiting)."""
        return self.max_concurrency + self.max_queue

    @property
    def running(self) -> bool:
        return self._started and self.channel.alive

    async def start(self) -> None:
        if not self.running:
            self.channel.start(self._receive)
            self._started = True

    async def stop(self) -> None:
        """Stop the engine loop (a step under way ends first); sequences still there finish
        with "error"."""
        if self._started:
            await self.channel.close()
            self._started = False
        self._fail_all()

    def _fail_all(self) -> None:
        """End every sequence with "error" (their rows are freed at the engine's next step,
        if it has not cleared them already)."""
        for stream in list(self._streams.values()):
            self._finish(stream, "error", notify=True)
        for answer in self._adapter_ops.values():
            answer.set_result("the engine stopped")
        self._adapter_ops.clear()

    # ---- submitting -----------------------------------------------------------------------

    def submit(self, requests: Sequence[SequenceRequest]) -> Submission:
        """Queue sequences (all or none); raises `QueueFull` when they do not fit,
        `EngineStopped` when the engine loop is not running."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        held = len(self._streams)
        if held + len(requests) > self.capacity:
            raise QueueFull(
                f"{held} sequences are running or waiting; at most {self.capacity} "
                f"(max_concurrency {self.max_concurrency} + max_queue {self.max_queue})"
            )
        submission = Submission(self)
        ops = []
        for choice, request in enumerate(requests):
            key, self._next_key = self._next_key, self._next_key + 1
            stream = Stream(key, choice, submission)
            submission.sequences.append(stream)
            self._streams[key] = stream
            ids = list(request.prompt_ids)
            ops.append(
                ("add", key, ids, request.params, request.seed, request.num_logprobs,
                 request.adapter)
            )  # fmt: skip
        self._num_waiting += len(ops)
        self.channel.send(ops)
        return submission

    async def change_adapter(self, action: str, name: str, path: str | None = None) -> None:
        """Load ("load_adapter", `name` from `path`) or unload ("unload_adapter") a LoRA adapter
        in the engine loop, between steps; raises ConfigError with what was wrong."""
        if not self.running:
            raise EngineStopped("the engine is not running")
        op_id, self._next_key = self._next_key, self._next_key + 1
        answer = asyncio.get_running_loop().create_future()
        self._adapter_ops[op_id] = answer
        self.channel.send([(action, op_id, name) + ((path,) if action == "load_adapter" else ())])
        error = await answer
        if error is not None:
            raise ConfigError(error)

    # ---- messages from the engine loop ----------------------------------------------------

    def _receive(self, message: tuple) -> None:
        """On the event loop: ("step", tokens, seconds) or ("failed", what to log)."""
        if message[0] == "step":
            self._dispatch(message[1], message[2])
        else:  # a bug, not the client's doing: fail what ran, keep serving (one process)
            logger.error("%s", message[1])
            self._fail_all()

    def _dispatch(self, tokens: list[tuple], seconds: float) -> None:
        """One step's tokens to their requests."""
        self.num_steps += 1
        if self.on_step is not None:
            self.on_step(len(tokens), seconds)
        touched: dict[int, Submission] = {}
        for token in tokens:
            if token[0] == "adapter":  # a load or unload's answer
                _, op_id, error = token
                self._adapter_ops.pop(op_id).set_result(error)
                continue
            key, token_id, text, finish_reason, logprob, top, is_stop_token, cached = token
            stream = self._streams.get(key)
            if stream is None:  # cancelled (its cancel crossed this step)
                continue
            if not stream.num_tokens:
                self._num_waiting -= 1
                stream.cached_tokens = cached
                if self.on_first_token is not None:
                    self.on_first_token(cached)
            stream.num_tokens += 1
            submission = stream.submission
            submission.pending.append(
                TokenOutput(
                    stream.choice,
                    token_id,
                    text,
                    finish_reason,
                    None if logprob is None else _finite(logprob),
                    None if top is None else [(i, _finite(v)) for i, v in top],
                    is_stop_token,
                )
            )
            touched[id(submission)] = submission
            if finish_reason is not None:
                stream.finish_reason = finish_reason
                self._finish(stream, finish_reason, notify=False)
        every_step = self.num_steps % self._stream_interval() == 0
        for submission in touched.values():
            submission.deliver(every_step=every_step)

    def _stream_interval(self) -> int:
        """Steps between deliveries of a running sequence's tokens to its request."""
        if self.stream_interval is not None:
            return self.stream_interval
        return max(1, self.num_running // RUNNING_PER_STREAM_INTERVAL)

    def shut_down_sessions(self, reason: str = "shutdown") -> None:
        """End every sequence now (the drain's grace period ran out): each submission gets a
        last output with `finish_reason = reason` and its rows are freed at the next step."""
        for stream in list(self._streams.values()):
            submission = stream.submission
            if not submission.cancelled:
                submission.cancel(reason)
                last = TokenOutput(stream.choice, -1, "", reason)
                submission.deliver(every_step=True, last=last)

    def _finish(self, stream: Stream, reason: str, *, notify: bool) -> None:
        """Take a sequence out (its row is free for the next step)."""
        if self._streams.pop(stream.key, None) is None:
            return
        if not stream.num_tokens:
            self._num_waiting -= 1
        if stream.finish_reason is None:  # cancelled: the engine frees its row
            stream.cancelled = True
            if self.channel.alive:
                self.channel.send([("cancel", stream.key)])
        if notify:
            last = TokenOutput(stream.choice, -1, "", reason)
            stream.submission.deliver(every_step=True, last=last)
        if self.on_finish is not None:
            self.on_finish(reason, stream.num_tokens)


# Under load, tokens reach their requests every few steps (see `Engine`'s stream_interval):
# one step more between deliveries for every this many running sequences.
RUNNING_PER_STREAM_INTERVAL = 8

HEARTBEAT_S = 60.0  # idle rank 0 tells the other processes it is alive this often
GRAMMAR_POLL_S = 0.002  # how often the idle loop looks at a compiling grammar


# ---- the engine loop ------------------------------------------------------------------------


def run_engine(core, channel, mirror: Callable[[list[tuple], str], None] | None = None) -> None:
    """Step `core` while there is work, until `channel.take` says stop: the engine loop.

    `channel.take(wait, timeout)` returns the ops that arrived (waiting for some when `wait`,
    at most `timeout` seconds) or None to stop; `channel.post(message)` sends ("step", tokens,
    seconds) after each step, ("failed", the traceback) after a step that raised. `mirror`:
    rank 0 under tensor parallelism (see the module docstring)."""
    sequences: dict[int, EngineSequence] = {}
    held: list[tuple] = []  # "add" ops whose grammar is compiling (`ready_ops`)
    timeout = HEARTBEAT_S if mirror is not None else None
    while (ops := channel.take(not core.has_work, GRAMMAR_POLL_S if held else timeout)) is not None:
        ops, held = ready_ops(core, held, ops)
        if not ops and not core.has_work:  # idle past the heartbeat interval (or a compile's)
            if mirror is not None:
                mirror([], "wait")
            continue
        started = time.perf_counter()
        try:
            if mirror is not None:
                mirror(ops, "step")
            tokens = apply_ops(core, ops, sequences)
        except Exception:
            core.clear()
            sequences.clear()
            channel.post(("failed", "generation step failed:\n" + traceback.format_exc()))
            if mirror is not None:
                break  # the processes are out of step: nothing to keep serving with
            continue
        channel.post(("step", tokens, time.perf_counter() - started))
    core.clear()
    if mirror is not None:
        mirror([], "stop")


def ready_ops(core, held: list[tuple], ops: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """(the ops to apply this step, those held back): the `held` ops and the new `ops`, but an
    "add" whose JSON format's grammar is still compiling on the grammar threads waits, so that
    a new schema does not stall the streams running (a held add and its cancel both go). The
    first time an add waits, a ("grammar", format) op goes ahead: under tensor parallelism the
    other processes start compiling it too."""
    cancelled = {op[1] for op in ops if op[0] == "cancel"}
    now, later = [], []
    for is_new, op in [*((False, op) for op in held), *((True, op) for op in ops)]:
        json_format = op[3].json_format if op[0] == "add" else None
        if json_format is not None and op[1] in cancelled:
            continue
        if json_format is not None and _compiling(core, json_format):
            if is_new:
                now.append(("grammar", json_format))
            later.append(op)
        else:
            now.append(op)
    return now, later


def _compiling(core, json_format) -> bool:
    """Whether `json_format`'s grammar is compiling (starting it if not compiled yet)."""
    try:
        return not core.grammars().prepare(json_format).done()
    except ConfigError:  # no tokenizer: `core.sequence` says so in the add's error
        return False


def apply_ops(core, ops: list[tuple], sequences: dict[int, EngineSequence]) -> list[tuple]:
    """Apply a step's ops to `core` and run the step; `sequences` holds this process's
    sequences by key. Returns the step's tokens as (key, token id, text, finish reason,
    logprob, top logprobs, is stop token, prompt tokens the prefix cache served: on a
    sequence's first token, else 0) tuples."""
    tokens = []
    for op in ops:
        if op[0] == "add":
            key, ids, params, seed, num_logprobs, adapter = op[1:]
            try:
                sequence = core.sequence(
                    ids, params, seed=seed, num_logprobs=num_logprobs, adapter=adapter
                )
            except ConfigError:  # its adapter was unloaded after the request was checked
                tokens.append((key, -1, "", "error", None, None, False, 0))
                continue
            sequences[key] = sequence
            core.add([sequence])
        elif op[0] == "cancel" and op[1] in sequences:
            core.cancel(sequences.pop(op[1]))
        elif op[0] == "grammar":  # compiled ahead of its add (`ready_ops`)
            core.grammars().prepare(op[1])
        elif op[0] in ("load_adapter", "unload_adapter"):
            tokens.append(_adapter_op(core, op))
    events = core.step() if core.has_work else []  # (an op alone: a grammar's compile)
    keys = {id(sequence): key for key, sequence in sequences.items()}
    for sequence, event in events:
        key = keys.get(id(sequence))
        if key is not None:  # (not one cancelled before its last launch came back)
            tokens.append(
                (
                    key,
                    event.token_id,
                    event.text,
                    event.finish_reason,
                    event.logprob,
                    event.top_logprobs,
                    event.is_stop_token,
                    sequence.cached_tokens if len(sequence.token_ids) == 1 else 0,
                )
            )
    for key in [key for key, sequence in sequences.items() if sequence.done]:
        del sequences[key]
    return tokens


def _adapter_op(core, op: tuple) -> tuple:
    """("load_adapter", op id, name, path) or ("unload_adapter", op id, name) on `core` ->
    ("adapter", op id, None or what was wrong), posted among the step's tokens."""
    try:
        if op[0] == "load_adapter":
            core.load_adapter(op[2], op[3])
        else:
            core.unload_adapter(op[2])
    except (ConfigError, ModelFormatError) as err:
        return ("adapter", op[1], str(err))
    return ("adapter", op[1], None)


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


class ThreadChannel:
    """The engine loop in a thread of the event loop's process.

    Args:
        core: the core engine (`Generator.engine`).
        mirror: rank 0 under tensor parallelism (see the module docstring).
    """

    def __init__(self, core, *, mirror: Callable[[list[tuple], str], None] | None = None) -> None:
        self.core = core
        self.mirror = mirror
        self._ops: list[tuple] = []  # for the next step (taken under _lock)
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set when ops are added or the loop should stop
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._deliver: Callable[[tuple], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # the front end's side (event loop)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, deliver: Callable[[tuple], None]) -> None:
        """Run the engine loop; its messages reach `deliver` on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._deliver = deliver
        self._stopping = False
        self._thread = threading.Thread(
            target=run_engine, args=(self.core, self, self.mirror), name="lmforge-engine"
        )
        self._thread.daemon = True
        self._thread.start()

    def send(self, ops: list[tuple]) -> None:
        with self._lock:
            self._ops += ops
        self._wake.set()

    async def close(self) -> None:
        """Stop the engine loop (a step under way ends first) and wait for it."""
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        with self._lock:
            self._ops = []

    # the engine loop's side (its thread)

    def take(self, wait: bool, timeout: float | None) -> list[tuple] | None:
        if wait:
            self._wake.wait(timeout)
        self._wake.clear()  # before taking: ops sent from here on set it again
        if self._stopping:
            return None
        with self._lock:
            ops, self._ops = self._ops, []
        return ops

    def post(self, message: tuple) -> None:
        self._loop.call_soon_threadsafe(self._deliver, message)


def _finite(value: float) -> float:
    """JSON has no -inf: a probability of zero becomes the lowest float."""
    return value if math.isfinite(value) else -3.4e38
