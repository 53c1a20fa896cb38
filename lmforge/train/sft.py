"""`lmforge sft`: instruction finetuning (full, LoRA or QLoRA) on the one training loop.

Only the data and the loss differ from pretraining: chat-rendered samples whose prompt tokens
are masked out of the labels (unless data.train_on_input), and the same next-token loss.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.data.sft import SFTLoader, load_sft_data
from lmforge.train.config import SFTJob
from lmforge.train.losses import CausalLMLoss
from lmforge.train.stage import ReshardPolicy, data_loader_factory, heldout_factory, run_stage


def sft(job: SFTJob, *, reshard: ReshardPolicy) -> Path:
    """Finetune to `train.steps` (resuming from the run dir's checkpoints); returns the artifact.
    `reshard` decides parallel.reshard_after_forward = "auto" (`ReshardPolicy`)."""
    job.require_data()
    return run_stage(
        job,
        stage="sft",
        make_batches=data_loader_factory(job, "sft", load_sft_data, SFTLoader),
        make_heldout=heldout_factory(job, load_sft_data, SFTLoader),
        reshard=reshard,
        make_loss_step=lambda model, spec, layout: CausalLMLoss.for_layout(
            layout, compile=job.parallel.compile
        ),
    )
