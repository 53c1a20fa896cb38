"""`lmforge dpo`: preference alignment (DPO / robust DPO / IPO) on the one training loop.

The reference model is the frozen starting point: with LoRA, the policy itself with its adapters
switched off (no second copy of the weights); with full finetuning, a frozen copy built and
sharded like the policy (in bf16 where the policy's weights are bf16, so the two score alike at
the start).
"""

from __future__ import annotations

from pathlib import Path

from lmforge.data.preference import PreferenceLoader, load_preference_data
from lmforge.train.config import DPOJob
from lmforge.train.losses import DPOLossStep, count_pairs
from lmforge.train.stage import (
    ReshardPolicy,
    data_loader_factory,
    frozen_reference,
    heldout_factory,
    resolve_reference,
    run_stage,
)


def dpo(job: DPOJob, *, reshard: ReshardPolicy) -> Path:
    """Align to `train.steps` (resuming from the run dir's checkpoints); returns the artifact.
    `reshard` decides parallel.reshard_after_forward = "auto" (`ReshardPolicy`), for the
    policy and a frozen reference alike."""
    job.require_data()
    kind = resolve_reference(job, job.dpo.reference, "dpo.reference")

    def make_loss_step(model, spec, layout) -> DPOLossStep:
        reference = None
        if kind == "frozen_copy":
            reference = frozen_reference(job, model, spec, layout, reshard)
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
