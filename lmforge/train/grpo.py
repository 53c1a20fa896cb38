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

import torch

from lmforge import models
from lmforge.data.prompts import PromptLoader, load_prompt_data
from lmforge.data.sft import default_pad_id
from lmforge.errors import ConfigError
from lmforge.modules.lora import (
    apply_lora,
    frozen_dtype,
    is_nf4,
    lora_modules,
    nf4_placeholders,
    nf4_to_empty,
)
from lmforge.train.config import GRPOJob
from lmforge.train.grpo_loss import GRPOLossStep, count_weighted_targets
from lmforge.train.loop import grad_accumulation_steps
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
    if layout.tp_size > 1:
        raise ConfigError(
            "lmforge grpo does not run with parallel.tp > 1 yet; use data parallelism (FSDP)"
        )
    if job.parallel.cpu_offload:
        raise ConfigError(
            "lmforge grpo cannot use parallel.cpu_offload (the engine samples on the device)"
        )
    if job.grpo.prompts_per_step % layout.dp_size:
        raise ConfigError(
            f"grpo.prompts_per_step = {job.grpo.prompts_per_step} must be a multiple of the "
            f"data-parallel size {layout.dp_size} (each rank samples for its share)"
        )


def _replica_factory(spec, layout, lora, bf16: bool):
    """() -> an unsharded model of the policy's structure (its LoRA adapters, its frozen
    weights' dtype, QLoRA's NF4 bases) on this rank's device, weights unset: what the engine
    samples from when FSDP shards the policy."""

    def make() -> torch.nn.Module:
        with torch.device("meta"):
            model = models.new_model(spec.args)
        if lora is not None:
            apply_lora(
                model,
                targets=lora.targets,
                rank=lora.rank,
                alpha=lora.alpha,
                base_dtype=frozen_dtype(lora, bf16),
            )
            if lora.quantize_base == "nf4":  # filled from the shards' NF4 bases, as packed
                nf4_placeholders(model, num_shards=1)
        model.to_empty(device=layout.device)
        for module in lora_modules(model).values() if lora is not None else ():
            if is_nf4(module.weight):
                nf4_to_empty(module.weight)
        model.tie_weights()
        model.init_buffers(layout.device)
        return model.requires_grad_(False).eval()

    return make


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
        )
        # run_stage makes the batches before the loss step: the rollouts exist by now.
        made["rollouts"].bind(
            model,
            reference=reference,
            base=kind == "adapters_disabled",
            make_replica=_replica_factory(
                spec, layout, lora_section(job), computes_in_bf16(job, layout)
            ),
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
