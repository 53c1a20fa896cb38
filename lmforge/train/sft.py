"""`lmforge sft`: instruction finetuning (full, LoRA or QLoRA) on the one training loop.

Only the data and the loss differ from pretraining: chat-rendered samples whose prompt tokens
are masked out of the labels (unless data.train_on_input), and the same next-token loss.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lmforge.data.sft import SFTLoader, load_sft_data
from lmforge.errors import ConfigError
from lmforge.train.config import SFTJob
from lmforge.train.losses import CausalLMLoss
from lmforge.train.stage import ModelSpec, run_stage

log = logging.getLogger(__name__)


def require_tokenizer(spec: ModelSpec, stage: str):
    if spec.tokenizer is None:
        raise ConfigError(
            f"{stage} needs a tokenizer: model.source {spec.source!r} has none; set model.tokenizer"
        )
    return spec.tokenizer


def sft(job: SFTJob) -> Path:
    """Finetune to `train.steps` (resuming from the run dir's checkpoints); returns the artifact."""
    if not job.data.path and not job.data.dataset:
        raise ConfigError("data.path (or data.dataset) is not set: name the instruction data")

    def make_loader(layout, spec) -> SFTLoader:
        tokenizer = require_tokenizer(spec, "sft")
        dataset = load_sft_data(job.data, tokenizer)
        if layout.is_main:
            log.warning("sft data: %s", dataset.summary())
        return SFTLoader.from_section(
            dataset.samples,
            job.data,
            tokenizer,
            micro_batch_size=job.train.micro_batch_size,
            dp_rank=layout.dp_rank,
            dp_size=layout.dp_size,
            seed=job.train.seed,
        )

    return run_stage(
        job,
        stage="sft",
        make_batches=make_loader,
        make_loss_step=lambda model, spec, layout: CausalLMLoss(compile=job.parallel.compile),
    )
