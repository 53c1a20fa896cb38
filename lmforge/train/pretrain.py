"""`lmforge pretrain`: next-token training on prepared token shards, from a preset (scratch) or
from any model (continued pretraining)."""

from __future__ import annotations

from pathlib import Path

from lmforge.data.pretrain import PackedLoader, TokenShards
from lmforge.train.config import PretrainJob
from lmforge.train.losses import CausalLMLoss
from lmforge.train.stage import ReshardPolicy, run_stage


def pretrain(job: PretrainJob, *, reshard: ReshardPolicy) -> Path:
    """Train to `train.steps` (resuming from the run dir's checkpoints) and return the artifact.
    `reshard` decides parallel.reshard_after_forward = "auto" (`ReshardPolicy`)."""
    job.require_data()
    shards = TokenShards(job.data.shards)

    def make_loader(layout, spec) -> PackedLoader:
        if spec.tokenizer is not None:
            shards.check_tokenizer(spec.tokenizer.fingerprint())
        return PackedLoader(
            shards,
            seq_len=job.data.seq_len,
            micro_batch_size=job.train.micro_batch_size,
            dp_rank=layout.dp_rank,
            dp_size=layout.dp_size,
            seed=job.train.seed,
            document_masking=job.data.document_masking,
        )

    return run_stage(
        job,
        stage="pretrain",
        make_batches=make_loader,
        reshard=reshard,
        make_loss_step=lambda model, spec, layout: CausalLMLoss.for_layout(
            layout, compile=job.parallel.compile
        ),
    )
