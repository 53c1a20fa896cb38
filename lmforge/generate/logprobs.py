"""Log-probabilities of given continuations: the one scorer behind lm-eval's `loglikelihood`
(and rolling perplexity) and the preference evaluator. Sequences are sorted by length and
right-padded (a causal mask leaves the real positions unchanged); only the scored positions go
through the output projection. On CUDA a small batch (lm-eval's multiple-choice requests) is
padded further, to a power-of-two batch and a width bucket, and its forward replayed as that
shape's CUDA graph, as the engine does with prefills: eager, the host's kernel launches take
longer than the device's work (1B, 16 tokens: 16 ms against 3.4 ms on an H200).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from lmforge.generate.attention import shape_free_attention
from lmforge.generate.engine import (
    PREFILL_FREE_TOKENS,
    ShapeForwards,
    StepGraphs,
    prefill_width,
)


@torch.inference_mode()
def sequence_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[tuple[Sequence[int], int]],
    *,
    batch_size: int,
    device: torch.device | str,
    graphs: bool | None = None,
) -> list[tuple[float, bool]]:
    """Log-probability of the last `n` tokens of each sequence given the tokens before them.

    Args:
        sequences: (tokens, n) pairs with 0 <= n < len(tokens).
        graphs: pad small batches to bucketed shapes and replay their forwards as CUDA graphs
            (None: on CUDA; elsewhere True pads and runs eagerly, for tests).
    Returns:
        per sequence, (sum of the n tokens' log-probabilities, whether each of them is the
        argmax), in the input order.
    """
    results: list[tuple[float, bool] | None] = [None] * len(sequences)
    order = sorted(
        (i for i, (tokens, n) in enumerate(sequences) if n > 0),
        key=lambda i: -len(sequences[i][0]),
    )
    for i, (_, n) in enumerate(sequences):
        if n == 0:
            results[i] = (0.0, True)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = len(sequences[batch[0]][0]) - 1  # the longest input of the batch
        inputs = torch.zeros(len(batch), width, dtype=torch.long)  # right-padded; causal
        for row, i in enumerate(batch):
            tokens = sequences[i][0]
            inputs[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        hidden = _hidden(model, inputs, device, graphs)  # [>= b, >= width, dim]
        # Input position p predicts token p + 1, so the last n tokens of a sequence with
        # input length L are predicted at positions L - n .. L - 1.
        picked, targets = [], []
        for row, i in enumerate(batch):
            tokens, n = sequences[i]
            length = len(tokens) - 1
            picked.append(hidden[row, length - n : length])
            targets.append(tokens[-n:])
        for i, result in zip(batch, _scored(model, picked, targets), strict=True):
            results[i] = result
    return results  # type: ignore[return-value]


def _scored(model, picked: list[torch.Tensor], targets: list[Sequence[int]]):
    """Per sequence, (the sum of its targets' log-probabilities, whether each is the argmax),
    from the hidden states [n, dim] that predict its n targets."""
    logits = model.output(torch.cat(picked))  # [sum n, vocab]
    logprobs = F.log_softmax(logits.float(), dim=-1)
    target = torch.tensor([t for ts in targets for t in ts], device=logprobs.device)
    chosen = logprobs.gather(-1, target[:, None]).squeeze(-1).tolist()
    greedy = (logprobs.argmax(-1) == target).tolist()
    results, offset = [], 0
    for ts in targets:
        n = len(ts)
        results.append((math.fsum(chosen[offset : offset + n]), all(greedy[offset : offset + n])))
        offset += n
    return results


def context_groups(sequences: Sequence[tuple[Sequence[int], int]]) -> list[list[int]]:
    """The indices of the scored sequences (n > 0) with the same context (the tokens before
    their last n), a list a context, in order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (tokens, n) in enumerate(sequences):
        if n > 0:
            groups.setdefault(tuple(tokens[: len(tokens) - n]), []).append(i)
    return list(groups.values())


@torch.inference_mode()
def shared_context_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[tuple[Sequence[int], int]],
    *,
    batch_size: int,
    device: torch.device | str,
) -> list[tuple[float, bool]]:
    """`sequence_logprobs`' results, where sequences with the same context (the tokens before
    their last n: a multiple-choice question's choices) run as one row: the context once, then
    each continuation's inputs (its tokens but the last) at the positions after the context,
    a mask letting each attend to the context and causally to itself only. A question with
    four choices is then one context and four continuations wide instead of four contexts;
    sequences whose context is their own take `sequence_logprobs`. `batch_size`: rows a
    forward."""
    groups = context_groups(sequences)
    alone = [i for i, (_, n) in enumerate(sequences) if n == 0]
    alone += [g[0] for g in groups if len(g) == 1]
    results: list[tuple[float, bool] | None] = [None] * len(sequences)
    scored = sequence_logprobs(model, [sequences[i] for i in alone], batch_size=batch_size,
                               device=device)  # fmt: skip
    for i, result in zip(alone, scored, strict=True):
        results[i] = result
    rows = [_packed_row([sequences[i] for i in g], g) for g in groups if len(g) > 1]
    rows.sort(key=lambda row: -len(row.inputs))
    for start in range(0, len(rows), batch_size):
        for i, result in _score_rows(model, rows[start : start + batch_size], device):
            results[i] = result
    return results  # type: ignore[return-value]


@dataclass
class _PackedRow:
    """One context and its continuations in one row (`shared_context_logprobs`)."""

    inputs: list[int]  # the context, then each continuation's tokens but its last
    positions: list[int]  # RoPE's: each continuation's start right after the context
    segments: list[int]  # 0: the context, s + 1: continuation s
    predicted_at: list[list[int]]  # per continuation: the inputs whose outputs predict it
    targets: list[list[int]]  # per continuation: its tokens
    owners: list[int]  # per continuation: its sequence's index


def _packed_row(members: list, owners: list[int]) -> _PackedRow:
    tokens, n = members[0]
    context = list(tokens[: len(tokens) - n])
    c = len(context)
    row = _PackedRow(context, list(range(c)), [0] * c, [], [], owners)
    for s, (tokens, n) in enumerate(members):
        continuation = list(tokens[-n:])
        first = len(row.inputs)
        row.inputs += continuation[:-1]
        row.positions += range(c, c + n - 1)
        row.segments += [s + 1] * (n - 1)
        row.predicted_at.append([c - 1, *range(first, first + n - 1)])
        row.targets.append(continuation)
    return row


def _score_rows(model, rows: list[_PackedRow], device) -> list[tuple[int, tuple[float, bool]]]:
    """One forward over packed rows (right-padded: a padding position attends to itself)."""
    width = len(rows[0].inputs)
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    segments = torch.full((len(rows), width), -1)
    for r, row in enumerate(rows):
        length = len(row.inputs)
        inputs[r, :length] = torch.tensor(row.inputs)
        positions[r, :length] = torch.tensor(row.positions)
        segments[r, :length] = torch.tensor(row.segments)
    query, key = segments[:, :, None], segments[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = causal & ((key == query) | ((key == 0) & (query >= 0)))  # [b, width, width]
    device = torch.device(device)
    with shape_free_attention(device):
        hidden = model(
            inputs.to(device), positions=positions.to(device), attn_mask=mask[:, None].to(device),
            return_hidden=True,
        )  # fmt: skip
    picked = [
        hidden[r, at] for r, row in enumerate(rows) for at in map(torch.tensor, row.predicted_at)
    ]
    targets = [continuation for row in rows for continuation in row.targets]
    owners = [owner for row in rows for owner in row.owners]
    return list(zip(owners, _scored(model, picked, targets), strict=True))


def _forward(model: torch.nn.Module, inputs: torch.Tensor, *, device) -> torch.Tensor:
    with shape_free_attention(device):
        return model(inputs, return_hidden=True)  # [b, width, dim]


def _padded_shape(batch: int, width: int, most: int) -> tuple[int, int] | None:
    """The (batch, width) a scoring batch pads to (a power of two; a width bucket, at most
    `most` positions), or None where it runs as it is: padding costs nothing while the
    forward is launch-bound, up to PREFILL_FREE_TOKENS tokens."""
    rows = 1 << (batch - 1).bit_length()
    width = prefill_width(width, most)
    return (rows, width) if rows * width <= PREFILL_FREE_TOKENS else None


_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ShapeForwards


def _hidden(model, inputs: torch.Tensor, device, graphs: bool | None) -> torch.Tensor:
    """Hidden states [>= b, >= width, dim] of right-padded inputs [b, width] (on the host)."""
    device = torch.device(device)
    if graphs is None:
        graphs = device.type == "cuda"
    shape = _padded_shape(*inputs.shape, model.args.max_seq_len) if graphs else None
    if shape is None:
        return _forward(model, inputs.to(device), device=device)
    padded = torch.zeros(shape, dtype=inputs.dtype)
    padded[: inputs.shape[0], : inputs.shape[1]] = inputs
    forwards = _FORWARDS.get(model)
    if forwards is None or forwards.device != device:
        step_graphs = StepGraphs() if device.type == "cuda" else None
        forwards = _FORWARDS[model] = ShapeForwards(device, step_graphs)
    return forwards.run("score", partial(_forward, model, device=device), padded)
