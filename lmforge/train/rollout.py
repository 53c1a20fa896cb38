"""GRPO's rollouts: completions sampled by the one engine from the policy being trained, in the
training process, scored, and packed into the micro-batches the one loop trains on.

`Rollouts` is the loop's batch iterator for `lmforge grpo`. Every grpo.mu optimizer steps it
makes a rollout batch:

1. weight sync: one `Engine` (lmforge.generate), made at the first rollout over the policy
   module itself and kept for the run. It reads the parameters the optimizer updates in place,
   so nothing is copied: the engine is made with `fuse=False` (its fused q/k/v and gate/up
   projections would be concatenated copies of the weights, made again after every update)
   and without its inference-only kernels and module swaps (GEMV, fused blocks, quantized
   kernels), which would replace the trained modules. On CUDA its decode steps are compiled
   once a run (grpo.compile_rollouts) and replayed as CUDA graphs. Its KV cache (max_batch ×
   data.max_seq_len slots) is taken for the rollout only (`Engine.reserve_cache`) and given
   back, with the graphs recorded over it, before the update (`Engine.release_cache`); taken
   again, it moves, and each step's graph records again (at once: its step compiled and
   tuned the first time). What the sync costs (`weight_sync_s`): taking the cache and
   switching the model to eval mode.
2. rollout: prompts_per_step prompts × G completions, sampled with the job's temperature,
   top-p/top-k and stop strings; each sequence draws from a seed of its own, from (train.seed,
   rollout index) and its place in the batch over all ranks, so a resumed run samples what the
   uninterrupted one did, and N processes what one does. A prompt is prefilled
   once: the other G - 1 sequences of its group copy its cached slots (all but the last
   prompt token, which each runs to sample its own first token; `prompt_tokens_shared`).
3. scoring: the rewards (lmforge.train.rewards), group-normalised advantages; groups whose
   rewards are all equal are dropped (grpo.drop_equal_groups) and counted.
4. the old log-probabilities (the policy that sampled, for the ratios of μ > 1 steps; with
   μ = 1 the loss step's own forward is the sampling policy's, `GRPOLossStep`) and the
   reference's (KL) with the trainer's own forward over the packed micro-batches, in eval mode;
   `logprob_gap` is the largest |engine − trainer| log-probability of a sampled token (with
   μ = 1 measured by the loss step, from the engine's log-probabilities in the batch).

Micro-batches: the kept sequences in order, train.micro_batch_size a micro-batch, as many
micro-batches as a step takes (global / micro); each micro-batch packs its sequences into rows
of at most data.max_seq_len positions (block-causal attention where a row holds several), or
with grpo.share_prompts a row per prompt: the prompt once, then its completions, each attending
to it. A micro-batch with no sequence left (dropped groups) is one row of padding with weight
0.

Several processes: each data-parallel rank samples for its share of the prompts; the engine
runs a replica of the policy (lmforge.train.replica): under FSDP2 an unsharded copy, the full
weights gathered into it before each rollout (with LoRA only the adapters, after the first
time; `weight_sync_s`); under tensor parallelism the policy's own shards in inference's layout
(no copy without FSDP), the tensor-parallel peers sampling the same prompts in step. Rewards,
advantages and groups are each data-parallel rank's own; the metrics are reduced over those
ranks (`reduce_over_ranks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmforge.data.prompts import PromptLoader, PromptSample
from lmforge.data.sft import IGNORE_INDEX, pack_samples
from lmforge.generate import Engine, SamplingParams
from lmforge.train.config import GRPOSection
from lmforge.train.grpo_loss import (
    at_labels,
    completion_logits,
    completion_logps,
    group_advantages,
    token_logps,
)
from lmforge.train.rewards import Completion, Reward, score_completions

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass
class Rollout:
    """One sampled completion, ready to train on."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    engine_logps: list[float] | None  # the engine's log-probability of each completion token


@dataclass
class _Piece:
    """Consecutive positions of a packed row: `ids` at RoPE positions `start`..; from `first`
    on they predict `rollout`'s completion tokens (no rollout: a shared prompt)."""

    ids: list[int]
    start: int
    rollout: Rollout | None
    first: int = 0


def _runs_of_one_prompt(rollouts: Sequence[Rollout]) -> list[list[Rollout]]:
    """`rollouts` cut where the prompt changes (a group's G sequences are consecutive)."""
    runs: list[list[Rollout]] = []
    for rollout in rollouts:
        if runs and runs[-1][0].prompt_ids == rollout.prompt_ids:
            runs[-1].append(rollout)
        else:
            runs.append([rollout])
    return runs


def rollout_seed(seed: int, rollout_index: int) -> int:
    """The first sampling seed of one rollout batch (its sequences count on from it)."""
    state = np.random.SeedSequence([seed, rollout_index]).generate_state(1, np.uint64)[0]
    return int(state) >> 2  # room for the sequences' offsets below 2**64


class Rollouts:
    """The loop's batches for GRPO (see the module docstring); `bind` the policy first.

    Args:
        prompts: this rank's prompt batches (prompts_per_step a batch).
        tokenizer: the model's (stop strings, texts for the rewards).
        rewards: the job's rewards.
        grpo: the job's grpo section.
        micro_batch_size, num_micro_batches: sequences a micro-batch, micro-batches a step.
        max_seq_len: data.max_seq_len, positions a packed row holds (and the engine's cache).
        pad_id: the token id of padding.
        device: where the model runs.
        bf16: the trainer's forwards compute in bf16 under autocast (the old log-probabilities
            are computed as the loss computes the new ones).
        seed: train.seed.
        heldout: prompts to evaluate greedily every grpo.eval_every steps (`evaluate`).
        total_steps: train.steps (the held-out prompts are also evaluated at the last).
        dp_rank, dp_size: this rank's place among the data-parallel ranks, each of which
            samples for its share of the prompts (`prompts` gives it that share).
        dp_group: the process group over the data-parallel ranks, whose metrics differ
            (tensor-parallel peers sample and score alike).
        width_multiple: packed rows are padded to a multiple of it (parallel.tp: sequence
            parallelism splits each row's positions evenly over the tensor-parallel ranks).
    """

    def __init__(
        self,
        *,
        prompts: PromptLoader,
        tokenizer,
        rewards: Sequence[Reward],
        grpo: GRPOSection,
        micro_batch_size: int,
        num_micro_batches: int,
        max_seq_len: int,
        pad_id: int,
        device: torch.device,
        bf16: bool,
        seed: int,
        heldout: Sequence[PromptSample] = (),
        total_steps: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        dp_group=None,
        width_multiple: int = 1,
    ) -> None:
        self.prompts, self.tokenizer, self.rewards = prompts, tokenizer, list(rewards)
        self.grpo = grpo
        self.micro_batch_size, self.num_micro_batches = micro_batch_size, num_micro_batches
        self.max_seq_len, self.pad_id = max_seq_len, pad_id
        self.device, self.bf16, self.seed = device, bf16, seed
        self.heldout, self.total_steps = list(heldout), total_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.dp_group, self.width_multiple = dp_group, width_multiple
        self.policy: torch.nn.Module | None = None
        self.sharded = False  # by FSDP2, whose mixed precision casts (no autocast)
        self.replica = None  # what the engine samples from, if not the policy (train.replica)
        self.engine: Engine | None = None  # made at the first rollout (`_engine`)
        self.eager = False  # the engine's decode step failed to compile: eager from then on
        self.reference: torch.nn.Module | None = None
        self.reference_is_base = False
        self.loss_step = None  # the job's GRPOLossStep (`bind`)
        self.num_rollouts = 0  # rollout batches made so far
        self.handed_out = 0  # micro-batches of the current rollout handed to the loop
        self.batches: list[dict[str, torch.Tensor]] = []  # the current rollout's, on the CPU
        self.metrics: dict[str, float] = {}  # the current rollout's
        self._ready_at = time.perf_counter()  # when the loop got a step's last micro-batch

    def bind(
        self,
        policy: torch.nn.Module,
        *,
        reference: torch.nn.Module | None,
        base: bool,
        replica=None,
        loss_step=None,
    ) -> None:
        """The model to sample from and train; the KL reference: a frozen model, or (`base`)
        the policy with its LoRA adapters off, or neither (no KL). `replica`: for a policy
        parallelized by FSDP or TP (or grpo.fuse_rollouts), what the engine samples from
        (`train.replica.make_replica`:
        its `model()` brings the policy's current weights, a collective every rank calls once
        a rollout). `loss_step`: the job's `GRPOLossStep`, which measures the engine-trainer
        gap when μ = 1 (`step_metrics` takes it)."""
        self.policy, self.reference, self.reference_is_base = policy, reference, base
        self.loss_step = loss_step
        self.sharded = hasattr(policy, "set_requires_gradient_sync")  # FSDP2's
        if self.sharded and replica is None:
            raise ValueError("a policy sharded by FSDP needs a replica to sample from")
        self.replica = replica

    # ---- the loop's iterator ------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        per_rollout = self.num_micro_batches * self.grpo.mu
        if not self.batches or self.handed_out == per_rollout:
            self._new_rollout()
        batch = self.batches[self.handed_out % self.num_micro_batches]
        self.handed_out += 1
        if self.handed_out % self.num_micro_batches == 0:
            self._ready_at = time.perf_counter()
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Prompt order, rollout count and the current rollout's micro-batches (a resumed run
        trains its remaining μ steps on the same sequences)."""
        return {
            "version": STATE_VERSION,
            "prompts": self.prompts.state_dict(),
            "num_rollouts": self.num_rollouts,
            "handed_out": self.handed_out,
            "batches": self.batches,
            "metrics": dict(self.metrics),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("version", -1)) != STATE_VERSION:
            raise ValueError(f"rollout state version {state.get('version')} is not supported")
        self.prompts.load_state_dict(state["prompts"])
        self.num_rollouts = int(state["num_rollouts"])
        self.handed_out = int(state["handed_out"])
        self.batches = list(state["batches"])
        self.metrics = dict(state["metrics"])

    def load_resharded_state_dict(self, state: dict[str, Any], *, saved_world_size: int) -> None:
        """Resume rank 0's saved state on another number of ranks: the prompt order and the
        rollout count carry over; the micro-batches of an unfinished rollout batch were rank
        0's share only, so they are dropped and the next step samples a new batch."""
        self.load_state_dict(state)
        if self.batches:
            log.warning(
                "resumed on another number of ranks (saved by %d): the rollout batch being "
                "trained on is dropped; the next step samples a new one",
                saved_world_size,
            )
        self.batches, self.handed_out = [], 0

    # ---- one rollout batch --------------------------------------------------------------

    def _new_rollout(self) -> None:
        assert self.policy is not None, "Rollouts.bind() was not called"
        start = time.perf_counter()
        prompts: list[PromptSample] = next(self.prompts)
        results, engine_logps, timing = self._generate(prompts)
        scored_at = time.perf_counter()
        rollouts, metrics = self._score(prompts, results, engine_logps)
        metrics["scoring_s"] = time.perf_counter() - scored_at
        logps_at = time.perf_counter()
        self.batches, gap = self._micro_batches(rollouts)
        metrics["logprob_s"] = time.perf_counter() - logps_at
        if gap is not None:
            metrics["logprob_gap"] = gap
        metrics.update(timing)
        metrics["rollout_total_s"] = time.perf_counter() - start
        self.metrics = metrics
        self.num_rollouts += 1
        self.handed_out = 0

    def _sampling_params(self) -> SamplingParams:
        grpo = self.grpo
        return SamplingParams(
            max_new_tokens=grpo.max_new_tokens,
            temperature=grpo.temperature,
            top_k=grpo.top_k or None,
            top_p=grpo.top_p,
            stop=tuple(grpo.stop),
        )

    @torch.no_grad()
    def _generate(self, prompts: list[PromptSample]):
        """G completions of each prompt on an engine over the policy's own weights -> (results
        in prompt-major order, the engine's token log-probabilities or None, timings)."""
        sequences, logps, timing = self._sample(lambda engine: self._sequences(engine, prompts))
        results = [s.result() for s in sequences]
        num_tokens = sum(len(r.token_ids) for r in results)
        timing["rollout_tokens_per_s"] = num_tokens / max(timing["rollout_s"], 1e-9)
        return results, logps, timing

    def _sample(self, make_sequences: Callable[[Engine], list]):
        """Run the sequences `make_sequences(engine)` makes on the rollout engine until all are
        done, its KV cache taken for it -> (sequences, log-probabilities or None, timings).
        Where the engine's decode step fails to compile (torch.compile's errors), warn and run
        them again on an eager engine, for the rest of the run."""
        sync_start = time.perf_counter()
        engine = self._engine()
        sync_s = time.perf_counter() - sync_start
        sequences = make_sequences(engine)
        shared_before = engine.num_shared_prompt_tokens
        rollout_start = time.perf_counter()
        try:
            logps = self._run(engine, sequences)
        except torch._dynamo.exc.TorchDynamoException as error:
            if not engine.compiled:
                raise
            self._drop_compiled_engine(error)
            return self._sample(make_sequences)
        rollout_s = time.perf_counter() - rollout_start
        shared = engine.num_shared_prompt_tokens - shared_before
        self._put_away(engine)  # its KV cache goes back before the update
        timing = {
            "prompt_tokens_shared": float(shared),
            "weight_sync_s": sync_s,
            "rollout_s": rollout_s,
        }
        return sequences, logps, timing

    def _drop_compiled_engine(self, error: Exception) -> None:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        log.warning(
            "the rollout engine's decode step did not compile (%s: %s); rollouts run eagerly "
            "from here (grpo.compile_rollouts = false skips the attempt)",
            type(error).__name__,
            first_line[:300],
        )
        self.engine.clear()
        self.engine.release_cache()
        self.engine, self.eager = None, True

    def _engine(self) -> Engine:
        """The rollout engine with its KV cache taken: made at the first rollout over the
        policy module itself (under FSDP: over its replica), then kept, its cache given back
        between rollouts (`_put_away`), so that its compiled steps compile once a run; under
        FSDP or TP the replica takes the policy's weights first."""
        model = self._sampling_model()
        if self.engine is not None:
            self.engine.reserve_cache()
            model.eval()  # no dropout while sampling (the update set it training)
            return self.engine
        self.engine = Engine(
            model,
            self.tokenizer,
            max_batch=self.grpo.rollout_batch
            or self.prompts.micro_batch_size * self.grpo.num_generations,
            max_seq_len=self.max_seq_len,
            device=self.device,
            compile=None if self.grpo.compile_rollouts and not self.eager else False,
            fuse=False,  # fused projections would be copies of the trained weights
            quantized_kernels=False,  # (these four swap the model's modules for inference's)
            gemv=False,
            fuse_blocks=False,
            fused_experts=False,
            cache_dtype=torch.bfloat16 if self.bf16 else None,  # what autocast computes
        )
        return self.engine

    def _put_away(self, engine: Engine) -> None:
        """The engine's KV cache back (and its CUDA graphs); the policy trains again."""
        engine.release_cache()
        self.policy.train()

    def _sampling_model(self) -> torch.nn.Module:
        """The module the engine runs: the policy itself, or its replica (FSDP, TP) with the
        policy's current weights."""
        return self.policy if self.replica is None else self.replica.model()

    def _sequences(self, engine: Engine, prompts: list[PromptSample]) -> list:
        """num_generations sequences a prompt, prompt-major; a group's first one prefills the
        prompt and the others copy it. Each draws from a seed of its own, from the rollout
        batch and its place in it over all ranks, so that it samples the same tokens whatever
        runs beside it (one process or several, any grpo.rollout_batch)."""
        params, num = self._sampling_params(), self.grpo.num_generations
        base = rollout_seed(self.seed, self.num_rollouts)
        sequences = []
        for i, prompt in enumerate(prompts):
            first = None
            batch_index = self.dp_rank + i * self.dp_size  # the prompt's, over all ranks
            for j in range(num):
                sequence = engine.sequence(
                    prompt.prompt_ids.tolist(),
                    params,
                    index=i * num + j,
                    seed=base + batch_index * num + j,
                    num_logprobs=0 if self.grpo.logprob_gap else None,
                    shares_prompt_with=first,
                )
                first = first or sequence
                sequences.append(sequence)
        return sequences

    def _run(self, engine: Engine, sequences: list) -> list[list[float]] | None:
        """Step the engine until every sequence is done -> the log-probability of each
        sampled token, per sequence (None when grpo.logprob_gap is off)."""
        logps: list[list[float]] = [[] for _ in sequences]
        engine.add(sequences)
        # The trainer's precision: under bf16 autocast, as its forwards run (frozen LoRA bases
        # are stored in bf16 beside fp32 embeddings, which only autocast multiplies together).
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            while engine.has_work:
                for sequence, event in engine.step():
                    logps[sequence.index].append(event.logprob)
        return logps if self.grpo.logprob_gap else None

    def _score(self, prompts: list[PromptSample], results, engine_logps):
        """Rewards, advantages and the kept groups' rollouts -> (rollouts, metrics)."""
        num = self.grpo.num_generations
        scores = score_completions(self.rewards, _completions(prompts, results, copies=num))
        rewards = torch.tensor(scores.total, dtype=torch.float64).view(len(prompts), num)
        advantages, equal = group_advantages(rewards, scale=self.grpo.scale_rewards)
        drop = equal if self.grpo.drop_equal_groups else torch.zeros_like(equal)
        kept = [(group, j) for group in range(len(prompts)) if not drop[group] for j in range(num)]
        truncated = [results[group * num + j].finish_reason != "stop" for group, j in kept]
        if self.grpo.mask_truncated:  # DAPO's overlong filtering
            kept = [at for at, cut in zip(kept, truncated) if not cut]
        rollouts = [
            Rollout(
                prompt_ids=prompts[group].prompt_ids.tolist(),
                completion_ids=list(results[group * num + j].token_ids),
                advantage=float(advantages[group, j]),
                engine_logps=None if engine_logps is None else engine_logps[group * num + j],
            )
            for group, j in kept
        ]
        lengths = [len(r.token_ids) for r in results]
        metrics = {
            "reward": rewards.mean().item(),
            "reward_std": rewards.std(dim=-1).mean().item(),
            "completion_len": float(np.mean(lengths)),
            "completion_len_max": float(max(lengths)),
            "stopped_fraction": float(np.mean([r.finish_reason == "stop" for r in results])),
            "groups_dropped": float(drop.sum().item()),
        }
        if self.grpo.mask_truncated:
            metrics["truncated_masked"] = float(sum(truncated))
        for name, values in scores.by_reward.items():
            metrics[f"reward_{name}"] = float(np.mean(values))
        if scores.correct is not None:
            metrics["accuracy"] = float(np.mean(scores.correct))
        return rollouts, metrics

    # ---- step metrics and held-out prompts ---------------------------------------------

    def step_metrics(self, step: int) -> dict[str, float]:
        """The metrics of the rollout batch the step trained on, the update's time (from its
        last micro-batch handed out to now: forwards, backwards and the optimizer) and, every
        grpo.eval_every steps and at the last, the held-out prompts' rewards."""
        metrics = {**self.metrics, "update_s": time.perf_counter() - self._ready_at}
        gap = self.loss_step.take_logprob_gap() if self.loss_step is not None else None
        if gap is not None:  # μ = 1: measured by the loss step
            metrics["logprob_gap"] = gap if math.isfinite(gap) else float("inf")
        every = self.grpo.eval_every
        if self.heldout and every and (step % every == 0 or step == self.total_steps):
            metrics.update(self.evaluate())
        if self.dp_size == 1:
            return metrics
        return reduce_over_ranks(metrics, self.device, group=self.dp_group)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts on the engine, scored by the rewards ->
        val_reward, val_reward_<name>, val_accuracy (where a reward checks correctness)."""
        start = time.perf_counter()
        greedy = dataclasses.replace(self._sampling_params(), temperature=0.0)
        sequences, _, _ = self._sample(
            lambda engine: [
                engine.sequence(prompt.prompt_ids.tolist(), greedy, index=index)
                for index, prompt in enumerate(self.heldout)
            ]
        )
        results = [sequence.result() for sequence in sequences]
        scores = score_completions(self.rewards, _completions(self.heldout, results, copies=1))
        metrics = {"val_reward": float(np.mean(scores.total))}
        for name, values in scores.by_reward.items():
            metrics[f"val_reward_{name}"] = float(np.mean(values))
        if scores.correct is not None:
            metrics["val_accuracy"] = float(np.mean(scores.correct))
        metrics["eval_s"] = time.perf_counter() - start
        return metrics

    # ---- packing and the trainer's log-probabilities ------------------------------------

    def _micro_batches(self, rollouts: list[Rollout]):
        """num_micro_batches packed micro-batches with old (and reference) log-probabilities
        -> (batches on the CPU, largest engine-trainer log-probability gap or None)."""
        batches, gap = [], None
        for index in range(self.num_micro_batches):
            chunk = rollouts[index * self.micro_batch_size : (index + 1) * self.micro_batch_size]
            batch, engine = self._pack(chunk)
            chunk_gap = self._add_logps(batch, engine)
            if chunk_gap is not None:
                gap = chunk_gap if gap is None else max(gap, chunk_gap)
            batches.append(batch)
        return batches, gap

    def _pack(self, chunk: list[Rollout]):
        """One micro-batch of `chunk`'s sequences packed into rows -> (batch, engine
        log-probabilities [r, s] at the labelled positions, or None)."""
        if not chunk:  # every group of this part of the step was dropped: padding, weight 0
            shape = (1, self.width_multiple)
            batch = {
                "inputs": torch.full(shape, self.pad_id, dtype=torch.long),
                "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
                "positions": torch.zeros(shape, dtype=torch.long),
                "advantages": torch.zeros(shape),
                "token_weights": torch.zeros(shape),
                "sequence_ids": torch.full(shape, -1, dtype=torch.long),
            }
            return batch, None
        rows = self._rows(chunk)
        width = max(sum(len(piece.ids) for piece in row) for row in rows)
        width = -(-width // self.width_multiple) * self.width_multiple
        shape = (len(rows), width)
        inputs = torch.full(shape, self.pad_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros(shape, dtype=torch.long)
        document_ids = torch.full(shape, len(chunk) + 1, dtype=torch.int32)  # padding: its own
        shared = torch.zeros(shape, dtype=torch.bool)
        advantages, weights = torch.zeros(shape), torch.zeros(shape)
        sequence_ids = torch.full(shape, -1, dtype=torch.long)  # a completion's tokens: its index
        index_of = {id(rollout): index for index, rollout in enumerate(chunk)}  # (equal ones too)
        engine = torch.zeros(shape) if chunk[0].engine_logps is not None else None
        for row, pieces in enumerate(rows):
            offset = 0
            for document, piece in enumerate(pieces):
                n = len(piece.ids)
                inputs[row, offset : offset + n] = torch.tensor(piece.ids)
                positions[row, offset : offset + n] = torch.arange(piece.start, piece.start + n)
                document_ids[row, offset : offset + n] = document
                rollout = piece.rollout
                if rollout is None:  # a prompt its group's completions share
                    shared[row, offset : offset + n] = True
                else:
                    span = slice(offset + piece.first, offset + n)  # predicting the completion
                    labels[row, span] = torch.tensor(rollout.completion_ids)
                    advantages[row, span] = rollout.advantage
                    sequence_ids[row, span] = index_of[id(rollout)]
                    weights[row, span] = self._token_weight(len(rollout.completion_ids))
                    if engine is not None:
                        engine[row, span] = torch.tensor(rollout.engine_logps)
                offset += n
        batch = {"inputs": inputs, "labels": labels, "positions": positions}
        if any(len(pieces) > 1 for pieces in rows):
            batch["document_ids"] = document_ids  # several pieces a row: block-causal
        if shared.any():
            batch["shared_prefix"] = shared  # ... and every piece sees its row's prompt
        batch.update(advantages=advantages, token_weights=weights, sequence_ids=sequence_ids)
        return batch, engine

    def _rows(self, chunk: list[Rollout]) -> list[list[_Piece]]:
        """The pieces of each packed row: whole sequences packed into rows of max_seq_len, or
        (grpo.share_prompts) a row per run of sequences of one prompt: the prompt but its last
        token once, then each completion after that token, attending to the prompt."""
        if not self.grpo.share_prompts:
            pieces = [
                _Piece(r.prompt_ids + r.completion_ids[:-1], 0, r, first=len(r.prompt_ids) - 1)
                for r in chunk
            ]
            packed = pack_samples([len(piece.ids) for piece in pieces], self.max_seq_len)
            return [[pieces[i] for i in row] for row in packed]
        rows = []
        for run in _runs_of_one_prompt(chunk):
            prompt, start = run[0].prompt_ids, len(run[0].prompt_ids) - 1
            row = [_Piece(prompt[:-1], 0, None)] if start else []
            row += [_Piece(prompt[-1:] + r.completion_ids[:-1], start, r) for r in run]
            rows.append(row)
        return rows

    def _token_weight(self, num_tokens: int) -> float:
        return 1.0 if self.grpo.loss_aggregation == "token" else 1.0 / num_tokens

    @torch.no_grad()
    def _add_logps(self, batch: dict, engine: torch.Tensor | None) -> float | None:
        """Put the sampling policy's (grpo.mu > 1) and the reference's (grpo.beta > 0) token
        log-probabilities at the sampling temperature into `batch` (`old_logps`, `ref_logps`);
        returns the largest gap between the engine's and the trainer's (temperature 1: the
        engine reports the raw ones). With μ = 1 the loss step's forward is the sampling
        policy's: the engine's log-probabilities go into the batch (`engine_logps`) for it to
        compare, and this returns None."""
        on_device = {k: v.to(self.device) for k, v in batch.items()}
        labels, gap = on_device["labels"], None
        with self._scoring():
            if self.grpo.mu > 1:
                mask = labels != IGNORE_INDEX
                logits, picked = completion_logits(self.policy, on_device), labels[mask]
                old = token_logps(logits, picked, temperature=self.grpo.temperature)
                batch["old_logps"] = at_labels(old, labels).cpu()
                if engine is not None and mask.any():
                    raw = old if self.grpo.temperature == 1.0 else token_logps(logits, picked)
                    gap = (raw - engine.to(self.device)[mask]).abs().max().item()
                del logits
            elif engine is not None:
                batch["engine_logps"] = engine
            if self.grpo.beta:
                batch["ref_logps"] = self._reference_logps(on_device).cpu()
        return gap if gap is None or math.isfinite(gap) else float("inf")

    @contextlib.contextmanager
    def _scoring(self):
        """The policy in eval mode (no dropout: the policy that sampled), under autocast as the
        loop computes (unless FSDP's mixed precision casts)."""
        self.policy.eval()
        try:
            autocast = self.bf16 and not self.sharded
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
                yield
        finally:
            self.policy.train()

    def _reference_logps(self, batch: dict) -> torch.Tensor:
        from lmforge.modules.lora import disable_adapters

        temperature = self.grpo.temperature
        if self.reference is not None:
            return completion_logps(self.reference, batch, temperature=temperature)
        assert self.reference_is_base, "grpo.beta > 0 needs a reference"
        with disable_adapters(self.policy):
            return completion_logps(self.policy, batch, temperature=temperature)


def _completions(prompts: Sequence[PromptSample], results, *, copies: int) -> list[Completion]:
    """What the rewards see of `results`, `copies` consecutive ones a prompt."""
    return [
        Completion(
            text=result.text,
            num_tokens=len(result.token_ids),
            sample=prompts[index // copies].fields,
            where=prompts[index // copies].where,
            token_ids=tuple(result.token_ids),
        )
        for index, result in enumerate(results)
    ]


# Metrics that add up over the data-parallel ranks, and those whose largest value is the one to
# log; the others are means over equal shares, averaged.
SUMMED = ("groups_dropped", "truncated_masked", "prompt_tokens_shared", "rollout_tokens_per_s")
LARGEST = ("completion_len_max", "logprob_gap")


def reduce_over_ranks(
    metrics: dict[str, float], device: torch.device, *, group=None
) -> dict[str, float]:
    """The metrics of every rank of `group` (default: all) as one (a collective: each calls it
    with the same keys): sums, maxima (the gap, the longest completion, every time: the
    slowest rank's) or means."""
    import torch.distributed as dist

    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    largest = values.clone()
    dist.all_reduce(values, group=group)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    world = dist.get_world_size(group)
    out = {}
    for key, total, top in zip(keys, values.tolist(), largest.tolist()):
        if key in SUMMED:
            out[key] = total
        elif key in LARGEST or key.endswith("_s"):
            out[key] = top
        else:
            out[key] = total / world
    return out
