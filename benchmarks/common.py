"""What the benchmarks share: lmforge's training step as the training commands run it (fused
AdamW, constant LR; no checkpoints or TensorBoard), the model built as the trainer builds it,
random batches, cleanup between rows, JSON output. Run the benchmarks from the repository root
with it on the path: `PYTHONPATH=$PWD python3 benchmarks/NAME.py`.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

PRESETS = {
    "1b": "llama3.2-1b",
    "3b": "llama3.2-3b",
    "8b": "llama3.1-8b",
    "tiny": "tiny",
    "moe": "qwen3-30b-a3b",  # shortened with train_throughput.py --num-layers to fit one GPU
}
LORA_RANK = 16


def cleanup() -> None:
    """Free the last row's memory and compiled code, and reset the peak statistics."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def write_json(out: str | Path, name: str, data, indent: int = 1) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(json.dumps(data, indent=indent))


def one_rank_layout(device: torch.device, *, mesh: bool = False):
    """One process; `mesh`: a one-process group and (1, 1, 1) mesh, for FSDP2 on one device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lmforge.parallel.distributed import MESH_AXES, Layout

    if mesh and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    grid = init_device_mesh(device.type, (1, 1, 1), mesh_dim_names=MESH_AXES) if mesh else None
    return Layout(rank=0, world_size=1, device=device, mesh=grid, dp_rank=0, dp_size=1, tp_size=1)


def random_batches(vocab: int, batch: int, seq: int, device, *, pairs: bool = False):
    """Random tokens forever; `pairs`: DPO's chosen and rejected batches."""
    generator = torch.Generator(device=device).manual_seed(0)

    def tokens():
        return torch.randint(0, vocab, (batch, seq + 1), device=device, generator=generator)

    while True:
        if pairs:
            chosen, rejected = tokens(), tokens()
            yield {"chosen_inputs": chosen[:, :-1], "chosen_labels": chosen[:, 1:],
                   "rejected_inputs": rejected[:, :-1], "rejected_labels": rejected[:, 1:]}  # fmt: skip
        else:
            t = tokens()
            yield {"inputs": t[:, :-1], "labels": t[:, 1:]}


def build_train_model(args, layout, parallel, *, lora: str | None = None, fsdp1: bool = False):
    """Meta device → LoRA swap → parallelize() → materialize → initialize, as the trainer does.
    lora: None, "lora" (rank 16 on the default targets: the blocks' seven linears; on a MoE
    attention's four and the experts, `lora.targets_for`) or "qlora" (its base in NF4);
    fsdp1: FSDP2 on a one-rank group (parallelize skips FSDP at dp size 1)."""
    from lmforge.models import new_model
    from lmforge.modules import lora as lora_
    from lmforge.train.parallelize import apply_fsdp, parallelize

    device, offload = layout.device, parallel.cpu_offload
    with torch.device("meta"):
        model = new_model(args)  # the family's model: Llama, Qwen3 or Qwen3-MoE
    if lora:  # as lmforge.train.stage in bf16 training: frozen linears stored in bf16
        base_dtype = torch.bfloat16 if device.type == "cuda" else None
        targets, rank = lora_.DEFAULT_TARGETS, LORA_RANK
        lora_.apply_lora(model, targets=targets, rank=rank, alpha=2.0 * rank, base_dtype=base_dtype)
    parallelize(model, layout, parallel, bf16=True)
    if fsdp1 and not offload:
        apply_fsdp(model, layout, parallel, bf16=True)
    model.to_empty(device="cpu" if offload else device)
    if not (fsdp1 or offload):
        model.tie_weights()
    model.init_buffers(device)
    torch.manual_seed(0)
    model.init_weights()
    if lora:
        lora_.reset_lora_parameters(model)
    if lora == "qlora":
        lora_.quantize_base_nf4(model)
    return model


# The Checkpointer interface, saving nothing.
NO_CHECKPOINTS = SimpleNamespace(latest=lambda: None, restore_latest=lambda state: None,
                                 save=lambda step, state: None, close=lambda: None,
                                 last_verified=None)  # fmt: skip


def bench_trainer(
    model: torch.nn.Module,
    layout,
    *,
    loss_step: Callable,
    batches: Iterator[dict],
    steps: int,
    micro_batch_size: int,
    accumulation: int = 1,
    bf16: bool = True,
    lr: float = 1e-4,
    count_targets: Callable | None = None,
    bf16_params: bool = False,
):
    """A Trainer over an already parallelized and initialized `model`; bf16_params: the
    weights in bf16 with fp32 masters in the optimizer (`build_optimizer`)."""
    from lmforge.train import config
    from lmforge.train.loop import LoopSections, Trainer
    from lmforge.train.losses import count_label_tokens
    from lmforge.train.optim import build_optimizer, build_scheduler

    optimizer = build_optimizer(
        model, config.OptimSection(lr=lr), layout.device, bf16_params=bf16_params
    )
    scheduler = build_scheduler(
        optimizer, config.SchedulerSection(warmup_steps=0, decay="constant"), steps
    )
    train = config.TrainSection(
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
            train,
            config.CheckpointSection(every=0),
            config.MetricsSection(tensorboard=False),
            config.ProfileSection(),
        ),
        run_dir=None,
        checkpointer=NO_CHECKPOINTS,
        checkpoint_state={},
        flops_per_token=1.0,
        bf16=bf16,
        count_targets=count_targets or count_label_tokens,
    )
