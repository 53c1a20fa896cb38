"""What the training benchmarks (train_throughput.py, memory.py) share: a Trainer that runs
lmforge's training step exactly as the training commands do (fused AdamW, constant LR), minus
checkpoints and TensorBoard.

Run the benchmarks from the repository root with it on the path: `PYTHONPATH=$PWD python3
benchmarks/NAME.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from lmforge.parallel.distributed import Layout
from lmforge.train.config import (
    CheckpointSection,
    MetricsSection,
    OptimSection,
    ProfileSection,
    SchedulerSection,
    TrainSection,
)
from lmforge.train.loop import LoopSections, Trainer
from lmforge.train.losses import count_label_tokens
from lmforge.train.optim import build_optimizer, build_scheduler


class NoCheckpoints:
    """The Checkpointer interface, saving nothing."""

    def latest(self):
        return None

    def restore_latest(self, state):
        return None

    def save(self, step, state):
        pass

    def close(self):
        pass


def bench_trainer(
    model: torch.nn.Module,
    layout: Layout,
    *,
    loss_step: Callable,
    batches: Iterator[dict],
    steps: int,
    micro_batch_size: int,
    accumulation: int = 1,
    bf16: bool = True,
    lr: float = 1e-4,
    count_targets: Callable = count_label_tokens,
    bf16_params: bool = False,
) -> Trainer:
    """A Trainer over an already parallelized and initialized `model`; bf16_params: the
    weights in bf16 with fp32 masters in the optimizer (`build_optimizer`)."""
    optimizer = build_optimizer(model, OptimSection(lr=lr), layout.device, bf16_params=bf16_params)
    scheduler = build_scheduler(
        optimizer, SchedulerSection(warmup_steps=0, decay="constant"), steps
    )
    train = TrainSection(
        steps=steps,
        micro_batch_size=micro_batch_size,
        global_batch_size=micro_batch_size * accumulation,
        mixed_precision="bf16" if bf16 else "fp32",
    )
    return Trainer(
        model=model,
        loss_step=loss_step,
        batches=batches,
        optimizer=optimizer,
        scheduler=scheduler,
        layout=layout,
        sections=LoopSections(
            train, CheckpointSection(every=0), MetricsSection(tensorboard=False), ProfileSection()
        ),
        run_dir=None,
        checkpointer=NoCheckpoints(),
        checkpoint_state={},
        flops_per_token=1.0,
        bf16=bf16,
        count_targets=count_targets,
    )
