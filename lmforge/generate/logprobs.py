"""Log-probabilities of given continuations: the one scorer behind lm-eval's `loglikelihood`
(and rolling perplexity) and the preference evaluator. Sequences are sorted by length and
right-padded (a causal mask leaves the real positions unchanged); only the scored positions go
through the output projection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lmforge.generate.attention import shape_free_attention


@torch.inference_mode()
def sequence_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[tuple[Sequence[int], int]],
    *,
    batch_size: int,
    device: torch.device | str,
) -> list[tuple[float, bool]]:
    """Log-probability of the last `n` tokens of each sequence given the tokens before them.

    Args:
        sequences: (tokens, n) pairs with 0 <= n < len(tokens).
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
        with shape_free_attention(device):
            hidden = model(inputs.to(device), return_hidden=True)  # [b, width, dim]
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
