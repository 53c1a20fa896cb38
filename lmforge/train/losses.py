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
from lmforge.data.sft import IGNORE_INDEX


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
        kwargs["attn_mask"] = build_block_causal_mask(
            batch["document_ids"], shared=batch.get("shared_prefix")
        )
    return kwargs


class CausalLMLoss:
    """Next-token prediction: pretraining, and SFT (with prompt tokens labelled IGNORE_INDEX).

    fused: the model takes the labels and returns the loss (`Transformer.forward(labels=)`):
    on a GPU its output projection and cross entropy run as one autograd step that never
    keeps the logits apart from their gradient (`lmforge.modules.cross_entropy`).
    compile: otherwise, compile the cross entropy, so the fp32 upcast is fused into the loss
    kernels instead of materializing fp32 logits [b, s, vocab] (8 GB at 8×2048 with Llama 3's
    vocab).
    """

    def __init__(self, *, compile: bool = False, fused: bool = False) -> None:
        self.fused = fused
        self.cross_entropy = torch.compile(token_cross_entropy) if compile else token_cross_entropy

    @classmethod
    def for_layout(cls, layout, *, compile: bool) -> CausalLMLoss:
        """A stage's loss: fused on GPUs, unless tensor parallelism shards the vocabulary."""
        fused = layout.device.type == "cuda" and layout.tp_size == 1
        return cls(compile=compile, fused=fused)

    def __call__(self, model, batch: dict) -> LossOutput:
        labels = batch["labels"]
        if self.fused and _takes_labels(model):
            loss_sum = model(batch["inputs"], labels=labels, **model_inputs(batch))
        else:
            loss_sum = self.cross_entropy(model(batch["inputs"], **model_inputs(batch)), labels)
        return LossOutput(loss_sum=loss_sum, num_tokens=(labels != IGNORE_INDEX).sum())


def _takes_labels(model) -> bool:
    """Whether the model's output projection is one the fused loss takes (not, e.g., QLoRA's
    NF4 output projection of an untied model)."""
    from lmforge.modules.cross_entropy import fusable_output  # imports Triton

    return fusable_output(getattr(model, "output", None))


causal_lm_loss = CausalLMLoss()


def count_label_tokens(batch: dict) -> torch.Tensor:
    """Target count of a next-token batch: the labelled tokens."""
    return (batch["labels"] != IGNORE_INDEX).sum()


def count_pairs(batch: dict) -> torch.Tensor:
    """Target count of a preference batch: DPO's loss is a mean over pairs."""
    # torch.full, not torch.tensor(..., device=cuda): that copies from the host and syncs.
    return torch.full((), batch["chosen_inputs"].shape[0], device=batch["chosen_inputs"].device)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of log p(label) over labelled positions, per row: logits [b, s, V], labels [b, s]
    -> [b] (fp32)."""
    mask = labels != IGNORE_INDEX
    safe = labels.masked_fill(~mask, 0)
    token_logps = -F.cross_entropy(
        logits.flatten(0, 1).float(), safe.flatten(), reduction="none"
    ).view(labels.shape)
    return (token_logps * mask).sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses and the implicit rewards, from sequence log-probabilities [b].

    sigmoid: DPO (Rafailov et al., 2023, eq. 7), with label smoothing as in robust DPO
    (Chowdhury et al., 2024, the conservative form): a fraction `label_smoothing` of the labels is
    treated as flipped. ipo: IPO (Azar et al., 2023, eq. 17): (h - 1/(2·beta))², where h is the
    difference of the policy-to-reference log-ratios.
    Returns (losses [b], chosen_rewards [b], rejected_rewards [b]).
    """
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    margin = chosen_ratio - rejected_ratio  # h_pi(y_w, y_l)
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * margin) * (1 - label_smoothing)
            - F.logsigmoid(-beta * margin) * label_smoothing
        )
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; allowed: sigmoid, ipo")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


class DPOLossStep:
    """DPO's `loss_step`: one forward of policy (and one of the reference) over chosen and
    rejected stacked into [2b, s].

    reference: a frozen model to score with, or None when the policy's LoRA adapters switched
    off *are* the reference (no second copy of the weights).
    """

    def __init__(self, *, beta: float, label_smoothing: float, loss_type: str, reference=None):
        self.beta, self.label_smoothing, self.loss_type = beta, label_smoothing, loss_type
        self.reference = reference

    @staticmethod
    def _stack(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.cat([batch["chosen_inputs"], batch["rejected_inputs"]])  # [2b, s]
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
        return inputs, labels

    def _reference_logps(self, model, inputs, labels) -> torch.Tensor:
        from lmforge.modules.lora import disable_adapters

        with torch.no_grad():
            if self.reference is not None:
                return sequence_logps(self.reference(inputs), labels)
            with disable_adapters(model):
                return sequence_logps(model(inputs), labels)

    def __call__(self, model, batch: dict) -> LossOutput:
        inputs, labels = self._stack(batch)
        half = inputs.shape[0] // 2
        policy = sequence_logps(model(inputs), labels)
        reference = self._reference_logps(model, inputs, labels)
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy[:half],
            policy[half:],
            reference[:half],
            reference[half:],
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            loss_type=self.loss_type,
        )
        return LossOutput(
            loss_sum=losses.sum(),
            num_tokens=torch.full((), half, device=inputs.device),  # no host sync
            metrics={  # sums over pairs; the loop divides by the step's pair count
                "rewards_chosen": chosen_rewards.sum(),
                "rewards_rejected": rejected_rewards.sum(),
                "reward_margin": (chosen_rewards - rejected_rewards).sum(),
                "preference_accuracy": (chosen_rewards > rejected_rewards).float().sum(),
            },
        )
