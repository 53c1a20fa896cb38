"""`lmforge dpo`: preference alignment (DPO / robust DPO / IPO) on the one training loop.

The reference model is the frozen starting point: with LoRA, the policy itself with its adapters
switched off (no second copy of the weights); with full finetuning, a frozen copy built and
sharded like the policy (in bf16 where the policy's weights are bf16, so the two score alike at
the start).
"""

from __future__ import annotations

from pathlib import Path

from lmforge.data.preference import PreferenceLoader, load_preference_data
from lmforge.errors import ConfigError
from lmforge.train.config import DPOJob
from lmforge.train.losses import DPOLossStep, count_pairs
from lmforge.train.optim import to_bf16_parameters
from lmforge.train.stage import (
    ReshardPolicy,
    bf16_weights,
    build_and_load_model,
    computes_in_bf16,
    data_loader_factory,
    heldout_factory,
    lora_section,
    run_stage,
)


def dpo(job: DPOJob, *, reshard: ReshardPolicy) -> Path:
    """Align to `train.steps` (resuming from the run dir's checkpoints); returns the artifact.
    `reshard` decides parallel.reshard_after_forward = "auto" (`ReshardPolicy`), for the
    policy and a frozen reference alike."""
    job.require_data()
    lora = lora_section(job)
    reference_kind = job.dpo.reference
    if reference_kind == "auto":
        reference_kind = "adapters_disabled" if lora is not None else "frozen_copy"
    if reference_kind == "adapters_disabled" and lora is None:
        raise ConfigError('dpo.reference = "adapters_disabled" needs lora.enabled = true')

    def make_loss_step(model, spec, layout) -> DPOLossStep:
        reference = None
        if reference_kind == "frozen_copy":
            bf16 = computes_in_bf16(job, layout)
            reference = build_and_load_model(spec, layout, job, bf16=bf16, reshard=reshard)
            reference = reference.eval()
            reference.requires_grad_(False)
            if bf16_weights(model):  # (fp32 masters in the optimizer) the same bf16 weights
                to_bf16_parameters(reference)
        return DPOLossStep(
            beta=job.dpo.beta,
            label_smoothing=job.dpo.label_smoothing,
            loss_type=job.dpo.loss_type,
            reference=reference,
        )

    return run_stage(
        job,
        stage="dpo",
        make_batches=data_loader_factory(job, "dpo", load_preference_data, PreferenceLoader),
        make_heldout=heldout_factory(job, load_preference_data, PreferenceLoader),
        make_loss_step=make_loss_step,
        reshard=reshard,
        count_targets=count_pairs,
    )
