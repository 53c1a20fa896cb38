"""Sampling the next token: greedy, temperature, min-p, top-k and nucleus (top-p), per row of a
batch.

`SamplingParams` is one request's settings (also its length limit, stop conditions and the JSON
its text must be);
`Sampler` turns the settings of a batch's rows into tensors once and then draws one token per
row from [b, vocab] logits per step, all rows at once. The order is vLLM's: the tokens a
constrained row's grammar does not allow masked (`mask_disallowed`, applied by the engine to the
logits it passes, greedy rows too), the stop tokens of rows still under their `min_tokens`
masked (greedy rows too), then temperature, min-p, top-k,
and top-p on what those kept (min-p and top-k commute: both keep a row's best tokens). A row's
draw is one
uniform number u in [0, 1) turned into a token by the inverse of its distribution (the first
token whose cumulative probability exceeds u): the uniforms come from a `torch.Generator`, the
engine's for a whole batch or a seeded sequence's own, drawn ahead for all its tokens, so a
seeded sequence draws the same tokens whatever rows sample beside it, in one call for the
whole batch. Nucleus sampling: Holtzman et al. 2019, https://arxiv.org/abs/1904.09751; min-p:
Nguyen et al. 2024, https://arxiv.org/abs/2407.01082.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from lmforge.errors import ConfigError
from lmforge.generate.grammar import JsonFormat


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one prompt is continued.

    Args:
        max_new_tokens: at most this many new tokens (fewer if the context fills up).
        temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling.
        top_k: sample among the k most likely tokens only (None or 0: all).
        top_p: sample from the smallest set of most likely tokens whose probability is >= top_p
            (1.0: all).
        min_p: sample among the tokens at least min_p times as likely as the most likely one
            (after temperature; 0: all, 1: only the most likely).
        stop: strings that end the generation; the text is cut before the first one found.
        stop_token_ids: token ids that end the generation (not part of the text); None: the
            tokenizer's stop ids (EOS, end of turn), or the model's EOS without a tokenizer;
            () for none.
        min_tokens: no stop token can be chosen, and no stop string ends the generation,
            before this many new tokens (vLLM's `min_tokens`; at most max_new_tokens).
        json_format: the text must be JSON of this format (lmforge/generate/grammar.py); it
            ends with a stop token once the JSON is complete (not with min_tokens, which could
            leave no token allowed).
    """

    max_new_tokens: int = 128
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0
    json_format: JsonFormat | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string is one stop string, not its characters
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature >= 0:  # also refuses NaN
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 1 (or 0 / None for no limit)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p={self.min_p} must be in [0, 1] (0: no limit)")
        if self.stop_token_ids is not None and any(i < 0 for i in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids={list(self.stop_token_ids)} must be ids >= 0")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"min_tokens={self.min_tokens} must be in 0..max_new_tokens ({self.max_new_tokens})"
            )
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")
        if self.json_format is not None and self.min_tokens:
            raise ConfigError(
                f"min_tokens={self.min_tokens} cannot go with a json_format: where the JSON is "
                "complete only a stop token is allowed"
            )

    @property
    def greedy(self) -> bool:
        """Whether the choice is always the most likely token."""
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Draws the next token for each row of a batch, with each row's own settings.

    Args:
        params: each row's settings.
        device: where the logits are.
        stop_ids: each row's stop token ids (what its `min_tokens` keeps from being chosen);
            needed only where a row has min_tokens.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        *,
        device: torch.device,
        stop_ids: Sequence[Collection[int]] | None = None,
    ) -> None:
        sampled = [p for p in params if not p.greedy]
        self.all_greedy = not sampled
        self.uses_top_k = any(p.top_k for p in sampled)
        self.uses_top_p = any(p.top_p < 1 for p in sampled)
        # When every sampled row keeps at most k tokens, only the largest k of all rows' logits
        # can be drawn: a top-k of those replaces sorting the whole vocabulary (the sort of
        # 64 rows x 128k took ~1 ms of a 64-stream server step on an H200).
        self.widest_top_k = (
            max(p.top_k for p in sampled) if sampled and all(p.top_k for p in sampled) else None
        )
        # Greedy rows are sampled at temperature 1 and then replaced by the argmax.
        self.greedy = to_device([p.greedy for p in params], device)
        self.temperature = to_device([1.0 if p.greedy else p.temperature for p in params], device)
        # At temperature 1 (GRPO's default) the division is a pass over [b, vocab] fp32 that
        # changes nothing (168 us a step at 512 x 128k on an H200)
        self.unit_temperature = all(p.greedy or p.temperature == 1.0 for p in params)
        self.top_k = to_device([p.top_k or 0 for p in params], device)
        self.top_p = to_device([p.top_p for p in params], device)
        # min-p in logit space: p / p_max >= min_p is logit >= max logit + log(min_p)
        self.uses_min_p = any(p.min_p > 0 for p in sampled)
        self.log_min_p = to_device(
            [math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params], device
        )
        self.min_tokens: torch.Tensor | None = None  # [b]; None: no row has min_tokens
        self.stop_ids: torch.Tensor | None = None  # [b, most stop ids of a row]
        if any(p.min_tokens for p in params):
            rows = [sorted(ids) for ids in (stop_ids or [()] * len(params))]
            if len(rows) != len(params):
                raise ValueError(f"{len(rows)} rows of stop_ids for {len(params)} rows")
            width = max(1, *map(len, rows))
            # a row's ids padded with its first (adding -inf twice is adding it once); a row
            # without any has nothing to mask: its min_tokens is taken as 0
            padded = [(ids + ids[:1] * width)[:width] if ids else [0] * width for ids in rows]
            self.min_tokens = to_device(
                [p.min_tokens if ids else 0 for p, ids in zip(params, rows)], device
            )
            self.stop_ids = to_device(padded, device)

    def __call__(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        uniforms: torch.Tensor | None = None,
        num_generated: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [b, vocab] (float; not changed) -> token ids [b] (int64); each sampled row
        draws with its entry of `uniforms` [b] (in [0, 1)), or with uniforms drawn from
        `generator`. `num_generated` [b]: the rows' new tokens so far, where a row's stop ids
        are masked while it is below its min_tokens (None: no row is)."""
        if num_generated is not None and self.min_tokens is not None:
            logits = mask_stop_ids(logits, self.stop_ids, num_generated < self.min_tokens)
        greedy_choice = logits.argmax(dim=-1)
        if self.all_greedy:
            return greedy_choice
        logits = logits.float()
        if not self.unit_temperature:
            logits = logits / self.temperature[:, None]
        if self.uses_min_p and not (self.uses_top_k or self.uses_top_p):
            floor = logits.amax(dim=-1, keepdim=True) + self.log_min_p[:, None]  # [b, 1]
            logits = logits.masked_fill(logits < floor, float("-inf"))
        if self.uses_top_k or self.uses_top_p:
            if self.widest_top_k is not None and self.widest_top_k < logits.shape[-1]:
                sorted_logits, order = logits.topk(self.widest_top_k, dim=-1)  # [b, k]
            else:  # descending; stable: among equal logits the lower id first, as argmax
                sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
            ranks = torch.arange(sorted_logits.shape[-1], device=logits.device)
            limit = torch.where(self.top_k > 0, self.top_k, logits.shape[-1])
            remove = ranks[None, :] >= limit[:, None]  # [b, vocab]: beyond top-k
            if self.uses_min_p:  # (the first column holds the row's largest logit)
                remove |= sorted_logits < sorted_logits[:, :1] + self.log_min_p[:, None]
            if self.uses_top_p:
                probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
                mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
                remove |= mass_before >= self.top_p[:, None]  # the first token always stays
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            # (the largest k: one scan, so that a row draws the same beside wider top-k rows)
            whole = sorted_logits.shape[-1] == logits.shape[-1]
            choice = inverse_cdf(sorted_logits.softmax(dim=-1), uniforms, generator, blocks=whole)
            sampled = order.gather(-1, choice[:, None]).squeeze(-1)
        else:
            sampled = inverse_cdf(logits.softmax(dim=-1), uniforms, generator)
        return torch.where(self.greedy, greedy_choice, sampled)


def mask_disallowed(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """logits [b, vocab] with the tokens that `rows` [k] may not take at -inf: bitmask [k,
    ceil(vocab / 32)] int32, bit j of word w set where token 32w + j is allowed (xgrammar's
    layout); a new tensor, the other rows as they were."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = (bitmask[:, :, None] >> bits).bitwise_and_(1).bool()  # [k, words, 32]
    allowed = allowed.flatten(1)[:, : logits.shape[-1]]  # [k, vocab]
    constrained = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_put((rows,), constrained)


def mask_stop_ids(
    logits: torch.Tensor, stop_ids: torch.Tensor, under: torch.Tensor
) -> torch.Tensor:
    """logits [b, vocab] with the ids `stop_ids` [b, m] of the rows `under` [b] (bool) at -inf,
    the others as they were; a new tensor, of fixed shapes whoever is under (a CUDA graph's
    step can hold it)."""
    penalty = torch.where(under, float("-inf"), 0.0).to(logits.dtype)  # [b]
    return logits.scatter_add(-1, stop_ids, penalty[:, None].expand(stop_ids.shape))


# Columns a block of `inverse_cdf`'s search: rows of more columns than four blocks are searched
# in two levels, the blocks' sums first (a scan over all of [512, 128k] fp32 took 444 us of a
# GRPO decode step on an H200; a sum over them reads the same bytes once and writes none)
CDF_BLOCK = 256


def inverse_cdf(
    probs: torch.Tensor,
    uniforms: torch.Tensor | None,
    generator: torch.Generator | None,
    *,
    blocks: bool = True,
) -> torch.Tensor:
    """probs [b, n] (rows sum to ~1) and uniforms [b] in [0, 1) (None: drawn from
    `generator`) -> for each row the first index whose cumulative probability exceeds its
    uniform (scaled by the row's total, so rounding cannot run past the last token): an exact
    draw from the row's distribution, where an index of probability 0 is never chosen. Wide rows
    (`blocks`) find their block of CDF_BLOCK columns by the blocks' cumulative sums, then the
    index in it: the same draws but where rounding puts a uniform on another side of a
    boundary."""
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device)
    if not blocks or probs.shape[-1] <= 4 * CDF_BLOCK:
        cdf = probs.cumsum(dim=-1)  # [b, n], non-decreasing
        targets = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]  # [b, 1]
        return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    block, rest = _block_draw(probs, uniforms)
    columns = block[:, None] * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
    inside = probs.gather(-1, columns.clamp(max=probs.shape[-1] - 1))  # [b, CDF_BLOCK]
    inside = inside.masked_fill(columns >= probs.shape[-1], 0)  # past the last block's end
    cdf = inside.cumsum(dim=-1)
    index = torch.searchsorted(cdf, rest[:, None], right=True).squeeze(-1)
    # `rest` is below the block's sum; where the in-block sum rounded below it, the block's
    # last token of nonzero probability (the block's sum is above 0: the search passed it)
    last = CDF_BLOCK - 1 - (inside > 0).flip(-1).int().argmax(dim=-1)
    chosen = block * CDF_BLOCK + torch.where(index < CDF_BLOCK, index, last)
    return chosen.clamp(max=probs.shape[-1] - 1)


def _block_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the block of CDF_BLOCK columns each row's draw falls in [b], the draw's remaining
    mass within that block [b])."""
    rows, n = probs.shape
    whole = n // CDF_BLOCK * CDF_BLOCK
    sums = probs[:, :whole].reshape(rows, -1, CDF_BLOCK).sum(dim=-1)  # [b, blocks]
    if whole < n:
        sums = torch.cat([sums, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=-1)
    cdf = sums.cumsum(dim=-1)
    targets = uniforms.to(cdf.dtype) * cdf[:, -1]  # [b]
    block = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(-1)
    block = block.clamp(max=cdf.shape[-1] - 1)
    before = cdf.gather(-1, (block - 1).clamp(min=0)[:, None]).squeeze(-1)
    return block, targets - torch.where(block > 0, before, torch.zeros_like(before))


def to_device(values, device: torch.device | str) -> torch.Tensor:
    """A host list or tensor on `device` without a sync: a copy from pageable host memory
    would wait for the device to finish its queued work (so on CUDA it goes through pinned
    memory, and the host runs on)."""
    tensor = torch.as_tensor(values)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
