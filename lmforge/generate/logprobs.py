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
            targets.extend(tokens[-n:])
        logits = model.output(torch.cat(picked))  # [sum n, vocab]
        logprobs = F.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(targets, device=logprobs.device)
        chosen = logprobs.gather(-1, target[:, None]).squeeze(-1).tolist()
        greedy = (logprobs.argmax(-1) == target).tolist()
        offset = 0
        for i in batch:
            n = sequences[i][1]
            results[i] = (math.fsum(chosen[offset : offset + n]), all(greedy[offset : offset + n]))
            offset += n
    return results  # type: ignore[return-value]


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
