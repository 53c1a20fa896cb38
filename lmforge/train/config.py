"""Config sections of the training stages (pretrain now; sft and dpo extend `TrainJob`).

Each component receives its own section: the optimizer gets `OptimSection`, `parallelize()`
gets `ParallelSection`, the checkpointer `CheckpointSection`, and so on.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt

from lmforge.config import ModelSection, Section
from lmforge.data.preference import PreferenceDataSection
from lmforge.data.sft import SFTDataSection
from lmforge.errors import ConfigError
from lmforge.modules.lora import LoRASection
from lmforge.parallel.config import ParallelSection


class DataSection(Section):
    """Token shards written by `lmforge prepare`."""

    shards: str = ""
    """Directory made by `lmforge prepare` (index.json, meta.json, tokens-*.bin)."""
    seq_len: PositiveInt = 2048
    document_masking: bool = False
    """Block-causal attention: tokens attend only within their own document."""


class OptimSection(Section):
    """AdamW (Loshchilov & Hutter, 2019)."""

    lr: PositiveFloat = 3e-4
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (
        0.9,
        0.95,
    )
    """Adam's moment decay rates, each in [0, 1)."""
    eps: PositiveFloat = 1e-8
    weight_decay: float = Field(0.1, ge=0)
    fused: bool | None = None
    """Fused kernel; None = where the device supports it."""
    bf16_params: bool | None = None
    """Keep the trainable weights in bf16, what the forward and backward compute with, and their
    fp32 values (masters) in the optimizer, which updates them in lmforge's AdamW kernel: no
    weight casts in each step, bf16 gradients and activations, as FSDP's mixed precision has.
    A step's micro-batches add their gradients up in fp32. None = wherever it applies: one CUDA
    device (no FSDP, no TP), bf16 compute, full training. false: fp32 weights under autocast."""


class SchedulerSection(Section):
    """Linear warmup, then decay to `min_lr_ratio * lr` at the last step."""

    warmup_steps: int = Field(100, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class TrainSection(Section):
    steps: PositiveInt = 1000
    micro_batch_size: PositiveInt = 8
    """Sequences per forward pass on each data-parallel rank."""
    global_batch_size: PositiveInt | None = None
    """Sequences per optimizer step over all ranks = micro_batch_size × grad accumulation ×
    data-parallel size. None: micro_batch_size × data-parallel size (no accumulation)."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this; 0 turns clipping off."""
    seed: int = Field(0, ge=0, lt=2**32)
    deterministic: bool = False
    """Deterministic algorithms (bit-identical resume on CPU fp32); slower on GPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16 compute with fp32 master weights and reductions; auto = bf16 on GPU, fp32 on CPU."""
    eval_every: int = Field(0, ge=0)
    """Held-out loss (`val_loss`) every N steps and at the last one; 0: never. SFT and DPO read
    data.heldout, in whole batches, on every rank."""
    preempt_signal: Literal["SIGUSR1", "SIGUSR2", "SIGTERM"] = "SIGUSR2"
    """Signal that asks for save-and-exit (besides SIGTERM); Slurm: --signal=B:USR2@120."""


class CheckpointSection(Section):
    every: int = Field(500, ge=0)
    """Save every N steps (0: only at the end and on preemption)."""
    keep_last: int = Field(2, ge=2)
    async_save: bool = False
    export_every: int = Field(0, ge=0)
    """Also write an artifact every N steps (0: only at the end)."""
    export_dtype: Literal["float32", "bfloat16"] = "bfloat16"


class MetricsSection(Section):
    log_every: PositiveInt = 10
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "lmforge"
    wandb_mode: Literal["online", "offline"] = "offline"
    peak_flops: PositiveFloat = 989e12
    """Peak FLOP/s of one device for MFU (989e12: H100/H200 dense bf16)."""


class ProfileSection(Section):
    enabled: bool = False
    start_step: PositiveInt = 5
    num_steps: PositiveInt = 3
    memory_snapshot: bool = False
    """Also record a CUDA memory snapshot (pickle for pytorch.org/memory_viz)."""


class TrainJob(Section):
    """Sections shared by every training stage."""

    run_dir: str = "runs/train"
    model: ModelSection = Field(default_factory=ModelSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    profile: ProfileSection = Field(default_factory=ProfileSection)


class PretrainJob(TrainJob):
    """`lmforge pretrain`: from a preset (scratch) or any model (continued pretraining)."""

    run_dir: str = "runs/pretrain"
    data: DataSection = Field(default_factory=DataSection)

    def require_data(self) -> None:
        if not self.data.shards:
            raise ConfigError(
                "data.shards is not set: pass the directory made by `lmforge prepare`"
            )


class SFTJob(TrainJob):
    """`lmforge sft`: instruction finetuning, full or with LoRA / QLoRA adapters."""

    run_dir: str = "runs/sft"
    data: SFTDataSection = Field(default_factory=SFTDataSection)
    lora: LoRASection = Field(default_factory=LoRASection)

    def require_data(self) -> None:
        if not self.data.path and not self.data.dataset:
            raise ConfigError("data.path (or data.dataset) is not set: name the instruction data")


class DPOSection(Section):
    """Direct preference optimization (Rafailov et al., 2023)."""

    beta: PositiveFloat = 0.1
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Robust DPO: the assumed fraction of flipped preference labels."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    reference: Literal["auto", "adapters_disabled", "frozen_copy"] = "auto"
    """auto: with LoRA, the policy with its adapters switched off; else a frozen copy."""


class DPOJob(TrainJob):
    """`lmforge dpo`: preference alignment of an artifact, with LoRA or full finetuning."""

    run_dir: str = "runs/dpo"
    data: PreferenceDataSection = Field(default_factory=PreferenceDataSection)
    lora: LoRASection = Field(default_factory=LoRASection)
    dpo: DPOSection = Field(default_factory=DPOSection)

    def require_data(self) -> None:
        if not self.data.path and not self.data.dataset:
            raise ConfigError("data.path (or data.dataset) is not set: name the preference data")
