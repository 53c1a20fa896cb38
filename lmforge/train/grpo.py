"""`lmforge grpo`: online RL with verifiable rewards (GRPO and its DAPO / Dr. GRPO options) on
the one training loop, its rollouts on the one engine over the weights being trained
(lmforge.train.rollout).

The KL reference (grpo.beta > 0 only) is the starting point: with LoRA, the policy itself with
its adapters switched off (no second copy of the weights); with full finetuning, a frozen copy
built like the policy, as `lmforge dpo` builds its reference.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lmforge.data.prompts import PromptLoader, load_prompt_data
from lmforge.data.sft import default_pad_id
from lmforge.errors import ConfigError
from lmforge.train.config import GRPOJob
from lmforge.train.grpo_loss import GRPOLossStep, count_weighted_targets
from lmforge.train.loop import grad_accumulation_steps
from lmforge.train.replica import make_replica
from lmforge.train.rewards import build_rewards
from lmforge.train.rollout import Rollouts
from lmforge.train.stage import (
    ReshardPolicy,
    computes_in_bf16,
    frozen_reference,
    lora_section,
    resolve_reference,
    run_stage,
)

log = logging.getLogger(__name__)


def reference_kind(job: GRPOJob) -> str | None:
    """'adapters_disabled', 'frozen_copy' (`resolve_reference`), or None without a KL term."""
    return resolve_reference(job, job.grpo.reference, "grpo.reference") if job.grpo.beta else None


def _check_layout(job: GRPOJob, layout) -> None:
    if job.parallel.cpu_offload:
        raise ConfigError(
            "lmforge grpo cannot use parallel.cpu_offload (the engine samples on the device)"
        )
    if job.grpo.prompts_per_step % layout.dp_size:
        raise ConfigError(
            f"grpo.prompts_per_step = {job.grpo.prompts_per_step} must be a multiple of the "
            f"data-parallel size {layout.dp_size} (each rank samples for its share)"
        )


def _rollouts(job: GRPOJob, layout, spec, rewards) -> Rollouts:
    """The loop's batch source: this rank's share of the prompts (and the held-out prompts)."""
    _check_layout(job, layout)
    if spec.tokenizer is None:
        raise ConfigError(
            f"grpo needs a tokenizer: model.source {spec.source!r} has none; set model.tokenizer"
        )
    dataset = load_prompt_data(job.data, spec.tokenizer, max_prompt_len=job.max_prompt_len)
    if layout.is_main:
        log.warning("grpo data: %s", dataset.summary())
    prompts = PromptLoader.from_section(  # this rank's share of each rollout batch
        dataset.samples,
        job.data,
        spec.tokenizer,
        micro_batch_size=job.grpo.prompts_per_step // layout.dp_size,
        dp_rank=layout.dp_rank,
        dp_size=layout.dp_size,
        seed=job.train.seed,
    )
    heldout = []
    if job.grpo.eval_every:
        heldout = load_prompt_data(
            job.data, spec.tokenizer, max_prompt_len=job.max_prompt_len, heldout=True
        ).samples
    return Rollouts(
        prompts=prompts,
        tokenizer=spec.tokenizer,
        rewards=rewards,
        grpo=job.grpo,
        micro_batch_size=job.train.micro_batch_size,
        num_micro_batches=grad_accumulation_steps(job.train, layout.dp_size),
        max_seq_len=job.data.max_seq_len,
        pad_id=default_pad_id(spec.tokenizer),
        device=layout.device,
        bf16=computes_in_bf16(job, layout),
        seed=job.train.seed,
        heldout=heldout,
        total_steps=job.train.steps,
        dp_rank=layout.dp_rank,
        dp_size=layout.dp_size,
        dp_group=layout.dp_group,
        width_multiple=layout.tp_size,
    )


def grpo(job: GRPOJob, *, reshard: ReshardPolicy) -> Path:
    """Train `train.steps` optimizer steps (a rollout batch every grpo.mu of them), resuming
    from the run dir's checkpoints; returns the artifact. `reshard` decides
    parallel.reshard_after_forward = "auto" (`ReshardPolicy`)."""
    job.require_data()
    kind = reference_kind(job)
    # User reward code is loaded here, so that its errors come before the model is read.
    rewards = build_rewards(job.grpo.rewards, max_new_tokens=job.grpo.max_new_tokens)
    made: dict[str, Rollouts] = {}

    def make_batches(layout, spec) -> Rollouts:
        made["rollouts"] = _rollouts(job, layout, spec, rewards)
        return made["rollouts"]

    def make_loss_step(model, spec, layout) -> GRPOLossStep:
        reference = None
        if kind == "frozen_copy":
            reference = frozen_reference(job, model, spec, layout, reshard)
        loss_step = GRPOLossStep(
            clip_low=job.grpo.clip_low,
            clip_high=job.grpo.clip_high,
            beta=job.grpo.beta,
            temperature=job.grpo.temperature,
            sequence_ratio=job.grpo.importance_sampling == "sequence",
        )
        replica = make_replica(
            model,
            spec,
            layout,
            lora_section(job),
            bf16=computes_in_bf16(job, layout),
            fuse=job.grpo.fuse_rollouts,
        )
        if layout.is_main:
            log.warning(
                "grpo rollouts: the engine samples from %s",
                replica.summary if replica else "the policy module itself (no copy)",
            )
        # run_stage makes the batches before the loss step: the rollouts exist by now.
        made["rollouts"].bind(
            model,
            reference=reference,
            base=kind == "adapters_disabled",
            replica=replica,
            loss_step=loss_step,
        )
        return loss_step

    return run_stage(
        job,
        stage="grpo",
        make_batches=make_batches,
        make_loss_step=make_loss_step,
        reshard=reshard,
        count_targets=count_weighted_targets,
    )
