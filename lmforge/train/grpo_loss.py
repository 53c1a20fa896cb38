"""GRPO's advantages and loss step (`lmforge grpo`), on the one training loop.

GRPO (Shao et al., 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300) samples G completions
per prompt and uses each completion's reward relative to its group as the advantage of all its
tokens, in PPO's clipped surrogate (Schulman et al., 2017):

    ratio_t = π(y_t | ...) / π_old(y_t | ...)
    loss_t  = -min(ratio_t · A, clip(ratio_t, 1 - ε_low, 1 + ε_high) · A) + β · KL_t

with the options of the papers that followed: separate low and high clips (DAPO, Yu et al.,
2025, https://arxiv.org/abs/2503.14476, "clip-higher"), advantages not divided by the group's
std (Dr. GRPO, Liu et al., 2025, https://arxiv.org/abs/2503.20783), one ratio a completion
(GSPO, Zheng et al., 2025, https://arxiv.org/abs/2507.18071: the exp of the mean of its tokens'
log-ratios, for each of its tokens), and KL_t the k3 estimator
exp(r - l) - (r - l) - 1 of KL(π || π_ref) (Schulman, "Approximating KL divergence", 2020),
l and r the policy's and the reference's token log-probabilities.

Aggregation is carried by the batch, not by the loss: every completion token has a weight
(`token_weights`: 1 for token-level aggregation, 1 / the completion's length for sequence
level, 0 elsewhere); a micro-batch's loss is Σ weight · loss_t and its target count Σ weight, and
the loop divides by the step's total, so the step's loss is the token mean (DAPO) or the mean
over completions of their token means (GRPO) whatever the packing and micro-batching.
"""

from __future__ import annotations

import torch

from lmforge.data.sft import IGNORE_INDEX
from lmforge.train.losses import LossOutput, model_inputs

# Added to a group's std before dividing, so that a group with nearly equal rewards does not
# blow its advantages up (TRL's value).
STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, *, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [P, G] (G completions of each of P prompts) -> (advantages [P, G], equal [P]):
    each reward minus its group's mean, divided by the group's std (unbiased) + STD_EPS when
    `scale`; `equal` marks the groups whose rewards are all the same (advantages all 0)."""
    rewards = rewards.double()
    advantages = rewards - rewards.mean(dim=-1, keepdim=True)
    if scale:
        advantages = advantages / (rewards.std(dim=-1, keepdim=True) + STD_EPS)
    equal = rewards.amax(dim=-1) == rewards.amin(dim=-1)
    return advantages.float(), equal


def token_logps(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0):
    """log p(label) at each position of logits [..., V] / temperature -> [...] fp32 (0 where
    labels are IGNORE_INDEX)."""
    mask = labels != IGNORE_INDEX
    picked, _ = PickedLogProbs.apply(
        logits.flatten(0, -2), labels.masked_fill(~mask, 0).flatten(), temperature, False
    )
    return picked.view(labels.shape) * mask


# Values of the fp32 temporaries `PickedLogProbs` makes at once: a chunk of rows of the [n, V]
# logits (2^26: 512 rows of a 128k vocabulary, 256 MB a temporary)
CHUNK_VALUES = 2**26


class PickedLogProbs(torch.autograd.Function):
    """logits [n, V] (any float dtype), labels [n], temperature T -> (log p(label) of
    softmax(logits / T) [n] fp32, the distributions' entropies [n] fp32, no gradient; empty
    when the fourth argument is False), a chunk of rows at a time. Only the logits are kept for
    the backward, which makes each chunk's softmax again: the eager way kept an fp32
    log-softmax [n, V] and made its gradient and the entropy's terms as more fp32 [n, V]
    tensors (18 bytes a vocabulary entry with bf16 logits, where this keeps the logits' 2 and a
    chunk's temporaries)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, with_entropy=True):
        picked, entropy, lse = [], [], []
        for rows in _chunks(logits):
            scaled = scaled_fp32(logits[rows], temperature)
            total = scaled.logsumexp(dim=-1)  # [r]
            log_probs = scaled - total[:, None]
            if with_entropy:  # (the scoring forwards read none)
                entropy.append(-(log_probs.exp() * log_probs).sum(dim=-1))
            picked.append(log_probs.gather(-1, labels[rows, None]).squeeze(-1))
            lse.append(total)
        ctx.save_for_backward(logits, labels, torch.cat(lse))
        ctx.temperature = temperature
        entropy = torch.cat(entropy) if entropy else logits.new_empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(entropy)
        return torch.cat(picked), entropy

    @staticmethod
    def backward(ctx, grad_picked, _):
        """d log p(label) / d logits = (one_hot(label) - softmax(logits / T)) / T."""
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for rows in _chunks(logits):
            weight = grad_picked[rows, None]  # [r, 1]
            chunk = (scaled_fp32(logits[rows], ctx.temperature) - lse[rows, None]).exp_()
            chunk.mul_(-weight).scatter_add_(-1, labels[rows, None], weight)
            grad[rows] = chunk / ctx.temperature if ctx.temperature != 1.0 else chunk
        return grad, None, None, None


def _chunks(logits: torch.Tensor):
    """Slices of rows of logits [n, V] of at most CHUNK_VALUES values (one row at least; one
    empty slice where n = 0)."""
    step = max(1, CHUNK_VALUES // max(1, logits.shape[-1]))
    return (slice(start, start + step) for start in range(0, max(1, logits.shape[0]), step))


def scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits in fp32 (fp64 stays) at the sampling temperature."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits / temperature if temperature != 1.0 else logits


def completion_logits(model, batch: dict) -> torch.Tensor:
    """The model's logits at the labelled (completion) positions only -> [n, V], in the order of
    `labels[labels != IGNORE_INDEX]`: the output projection skips the prompt positions, whose
    logits nothing reads (a third of a 128-token prompt's 384-position row, in fp32 ~1 GB of
    a 16-sequence micro-batch of a 128k vocabulary)."""
    completions = batch["labels"] != IGNORE_INDEX
    return model(batch["inputs"], logits_at=completions, **model_inputs(batch))


def completion_logps(model, batch: dict, *, temperature: float = 1.0) -> torch.Tensor:
    """log p(label) at every labelled position at `temperature` -> [b, s] fp32, 0 elsewhere."""
    labels = batch["labels"]
    picked = labels[labels != IGNORE_INDEX]
    return at_labels(
        token_logps(completion_logits(model, batch), picked, temperature=temperature), labels
    )


def at_labels(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """values [n] of the labelled positions, in order -> [b, s] (0 elsewhere; differentiable)."""
    mask = labels != IGNORE_INDEX
    return torch.zeros(labels.shape, dtype=values.dtype, device=values.device).masked_scatter(
        mask, values
    )


def grpo_token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token GRPO losses from token log-probabilities (all [b, s]).

    sequence_ids (GSPO): each completion token's sequence (0, 1, ... in the micro-batch; -1
    elsewhere): a token's ratio is then its sequence's, the exp of the mean log-ratio of the
    sequence's tokens. Returns (losses, clipped, kl): `clipped` is 1.0 where the clipped term is
    the smaller one (the token's gradient is cut), `kl` the k3 estimate (zeros without a
    reference).
    """
    log_ratio = logps - old_logps
    if sequence_ids is not None:
        log_ratio = sequence_means(log_ratio, sequence_ids)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    losses = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logps)
    if beta:
        if ref_logps is None:
            raise ValueError("grpo_token_losses: beta > 0 needs ref_logps")
        log_ratio = ref_logps - logps
        kl = torch.exp(log_ratio) - log_ratio - 1
        losses = losses + beta * kl
    return losses, (clipped < unclipped).float(), kl


def sequence_means(values: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """values [b, s] -> [b, s]: at each position of a sequence (sequence_ids >= 0) the mean of
    that sequence's values, 0 elsewhere (differentiable)."""
    member = sequence_ids >= 0
    ids = sequence_ids[member]
    count = sequence_ids.numel()  # more than there are sequences (their ids' max: a host sync)
    sums = values.new_zeros(count).index_add(0, ids, values[member])
    sizes = values.new_zeros(count).index_add(0, ids, torch.ones_like(values[member]))
    return torch.zeros_like(values).masked_scatter(member, (sums / sizes.clamp(min=1))[ids])


def count_weighted_targets(batch: dict) -> torch.Tensor:
    """Target count of a GRPO micro-batch: its tokens' aggregation weights (module docstring)."""
    return batch["token_weights"].sum()


class GRPOLossStep:
    """GRPO's `loss_step`: one forward of the policy over a micro-batch of (packed) rollouts.

    The batch (`lmforge.train.rollout`) holds `inputs`, `labels` [b, s] (completion tokens
    labelled, the rest IGNORE_INDEX), `positions` and, when rows hold several sequences,
    `document_ids`; per position `advantages`, `token_weights`, with a KL term `ref_logps`
    [b, s], `sequence_ids` (a completion token's sequence in the micro-batch, for
    `sequence_ratio`: GSPO), and `old_logps`, the sampling policy's, where the weights moved
    since it sampled (grpo.mu > 1). Without them the policy is the one that sampled (one
    optimizer step a rollout batch): the ratio is exp(logp - logp.detach()), 1 with logp's
    gradient, and the old log-probabilities' own forward is saved (TRL does the same). Then
    `engine_logps`, the engine's (temperature 1), if there, are compared with this forward's:
    the largest difference of a step is `take_logprob_gap()`.
    """

    def __init__(
        self,
        *,
        clip_low: float,
        clip_high: float,
        beta: float,
        temperature: float,
        sequence_ratio: bool = False,
    ) -> None:
        self.clip_low, self.clip_high = clip_low, clip_high
        self.beta, self.temperature = beta, temperature
        self.sequence_ratio = sequence_ratio  # GSPO: one ratio a sequence (`sequence_ids`)
        self._gap: torch.Tensor | None = None  # the largest engine - trainer gap so far

    def take_logprob_gap(self) -> float | None:
        """The largest |engine - trainer| log-probability since the last call (None: none
        measured here), and forget it."""
        gap, self._gap = self._gap, None
        return None if gap is None else gap.item()

    def __call__(self, model, batch: dict) -> LossOutput:
        labels = batch["labels"]
        labelled = labels != IGNORE_INDEX
        picked = labels[labelled]  # [n]
        logits = completion_logits(model, batch)  # [n, V]
        picked_logps, entropy = PickedLogProbs.apply(logits, picked, self.temperature)
        logps = at_labels(picked_logps, labels)  # [b, s]
        old_logps = batch.get("old_logps")
        if old_logps is None:  # the policy that sampled: ratio 1, logp's gradient
            old_logps = logps.detach()
            if "engine_logps" in batch:
                raw = picked_logps if self.temperature == 1.0 else token_logps(logits, picked)
                self._measure_gap(raw, batch["engine_logps"][labelled])
        losses, clipped, kl = grpo_token_losses(
            logps,
            old_logps,
            batch["advantages"],
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            beta=self.beta,
            ref_logps=batch.get("ref_logps"),
            sequence_ids=batch["sequence_ids"] if self.sequence_ratio else None,
        )
        weights = batch["token_weights"]
        metrics = {  # weighted like the loss; the loop divides by the step's total weight
            "clip_fraction": (clipped * weights).sum(),
            "entropy": (at_labels(entropy, labels) * weights).sum(),
        }
        if self.beta:
            metrics["kl"] = (kl.detach() * weights).sum()
        return LossOutput(
            loss_sum=(losses * weights).sum(), num_tokens=weights.sum(), metrics=metrics
        )

    @torch.no_grad()
    def _measure_gap(self, trainer: torch.Tensor, engine: torch.Tensor) -> None:
        """Keep the largest |trainer - engine| of these labelled positions' log-probabilities
        [n] (on the device: no sync)."""
        if trainer.numel():
            gap = (trainer.detach() - engine).abs().amax()
            self._gap = gap if self._gap is None else torch.maximum(self._gap, gap)
