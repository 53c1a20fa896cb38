"""Loss steps: `loss_step(model, batch) -> LossOutput`, one per training method.

A loss step returns the *sum* of per-token losses and the number of target tokens; the training
loop divides by the target tokens of the whole optimizer step (all micro-batches, all ranks), so
k micro-batches of b sequences give exactly the gradient of one batch of k·b.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmforge.data.pretrain import build_block_causal_mask

IGNORE_INDEX = -100


@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # scalar, sum over target tokens
    num_tokens: torch.Tensor  # scalar int, target tokens in this micro-batch
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # sums, divided like the loss


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross entropies over labels != IGNORE_INDEX, computed in fp32.

    logits [b, s, vocab], labels [b, s]."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def model_inputs(batch: dict) -> dict:
    """Keyword arguments for the model from a batch (positions and per-document masking)."""
    kwargs = {}
    if "positions" in batch:
        kwargs["positions"] = batch["positions"]
    if "document_ids" in batch:
        kwargs["attn_mask"] = build_block_causal_mask(batch["document_ids"])
    return kwargs


def causal_lm_loss(model, batch: dict) -> LossOutput:
    """Next-token prediction: pretraining, and SFT (with prompt tokens labelled IGNORE_INDEX)."""
    logits = model(batch["inputs"], **model_inputs(batch))
    labels = batch["labels"]
    return LossOutput(
        loss_sum=token_cross_entropy(logits, labels),
        num_tokens=(labels != IGNORE_INDEX).sum(),
    )
