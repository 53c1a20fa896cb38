"""Config sections of the training stages (pretrain now; sft, dpo and grpo extend `TrainJob`).

Each component receives its own section: the optimizer gets `OptimSection`, `parallelize()`
gets `ParallelSection`, the checkpointer `CheckpointSection`, and so on.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from lmforge.config import ModelSection, Section
from lmforge.data.preference import PreferenceDataSection
from lmforge.data.prompts import PromptDataSection
from lmforge.data.sft import SFTDataSection
from lmforge.errors import ConfigError
from lmforge.modules.lora import LoRASection
from lmforge.parallel.config import ParallelSection
from lmforge.train.rewards import RewardSection


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


class GRPOSection(Section):
    """Group relative policy optimization (Shao et al., 2024, DeepSeekMath), with the options
    of DAPO (Yu et al., 2025: clip-higher, token-level loss, equal groups dropped) and Dr. GRPO
    (Liu et al., 2025: no std normalisation)."""

    prompts_per_step: PositiveInt = 8
    """Prompts of one rollout batch (over all ranks); each gets num_generations completions, and
    the batch's prompts_per_step × num_generations sequences make one optimizer step
    (train.global_batch_size)."""
    num_generations: int = Field(8, ge=2)
    """G: completions sampled per prompt (the group its advantages are relative to)."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature; the loss scores tokens at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens (0: all)."""
    max_new_tokens: PositiveInt = 256
    stop: list[str] = Field(default_factory=list)
    """Strings that end a completion (besides the tokenizer's stop tokens)."""
    rollout_batch: int = Field(0, ge=0)
    """Sequences the engine decodes at once (its KV cache rows); 0: the whole rollout batch."""
    logprob_gap: bool = True
    """Measure the largest |engine - trainer| log-probability of the sampled tokens (the engine
    copies each sampled token's log-probability to the host with the token)."""
    compile_rollouts: bool = True
    """On CUDA, compile the rollout engine's decode steps and replay them as CUDA graphs (one
    compile a run; the graphs are recorded again each rollout, over its new KV cache); false:
    eager, as on the CPU."""
    fuse_rollouts: bool = False
    """In one process, sample from fused copies of each block's q/k/v and gate/up weights (one
    matmul each, as `lmforge generate` runs), copied in before each rollout: those weights'
    memory once more; the other weights stay the policy's own. (Under FSDP or TP the engine's
    replica is fused always: it is a copy anyway.) LoRA models stay unfused. On one H200 it
    made the 1B's rollouts 3% faster for 1.3 GB (docs/benchmarks.md, GRPO)."""
    mu: PositiveInt = 1
    """Optimizer steps on each rollout batch (μ), against its old log-probabilities."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """ε_low: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """ε_high: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher: 0.28)."""
    importance_sampling: Literal["token", "sequence"] = "token"
    """token: each token's own ratio π / π_old (GRPO, DAPO); sequence: GSPO (Zheng et al., 2025,
    https://arxiv.org/abs/2507.18071), one ratio a completion, the exp of its tokens' mean
    log-ratio, clipped as a whole for every token of it (the paper clips at clip_low = 3e-4,
    clip_high = 4e-4)."""
    scale_rewards: bool = True
    """Divide each group's advantages by its reward std (false: Dr. GRPO)."""
    loss_aggregation: Literal["token", "sequence"] = "token"
    """token: every completion token of the step weighs the same (DAPO); sequence: each
    completion's token mean, averaged over completions (GRPO's paper)."""
    drop_equal_groups: bool = True
    """Leave out of the update the groups whose rewards are all equal (no advantage: only the
    KL term would move them); counted as `groups_dropped`."""
    share_prompts: bool = False
    """In the update's forwards, a group's prompt once a row, its completions after it attending
    to it (block-causal), where each sequence would run its prompt again: of G·(P + C)
    positions, (G - 1)·(P - 1) fewer. For short completions: a row is W = P + G·C positions
    under a dense attention mask of W² entries (4.7M at 127 + 8·256; 1.1G at 8 × 4096 new
    tokens; `lmforge plan` counts the mask, not what the attention kernel may make of it). On
    one H200 it saved 3% of the 1B's update at P = 128, C = 256, G = 8."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: leave out of the update the completions cut at
    grpo.max_new_tokens (or the context) before a stop; their groups' advantages still count
    them. Counted as `truncated_masked`."""
    beta: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference (k3 estimator); 0: no KL and no reference."""
    reference: Literal["auto", "adapters_disabled", "frozen_copy"] = "auto"
    """With beta > 0. auto: with LoRA, the policy with its adapters off; else a frozen copy."""
    rewards: list[RewardSection] = Field(default_factory=list)
    """[[grpo.rewards]] entries: kind, weight and each kind's settings (lmforge.train.rewards)."""
    eval_every: int = Field(0, ge=0)
    """Greedy completions of data.heldout's prompts every N steps and at the last one, scored by
    the rewards: val_reward, val_reward_<name>, val_accuracy; 0: never."""


class GRPOJob(TrainJob):
    """`lmforge grpo`: online RL with verifiable rewards, rollouts on the one engine."""

    run_dir: str = "runs/grpo"
    data: PromptDataSection = Field(default_factory=PromptDataSection)
    lora: LoRASection = Field(default_factory=LoRASection)
    grpo: GRPOSection = Field(default_factory=GRPOSection)

    @model_validator(mode="after")
    def _one_step_is_one_rollout_batch(self) -> GRPOJob:
        sequences = self.grpo.prompts_per_step * self.grpo.num_generations
        given = self.train.global_batch_size
        if given is not None and given != sequences:
            raise ValueError(
                f"train.global_batch_size = {given}, but a grpo step trains on "
                f"grpo.prompts_per_step × grpo.num_generations = {sequences} sequences; "
                "leave train.global_batch_size unset"
            )
        if given is None:
            self.train.global_batch_size = sequences
        self._check_evaluation()
        if self.grpo.max_new_tokens >= self.data.max_seq_len:
            raise ValueError(
                f"grpo.max_new_tokens = {self.grpo.max_new_tokens} leaves no room for a prompt "
                f"in data.max_seq_len = {self.data.max_seq_len}"
            )
        return self

    def _check_evaluation(self) -> None:
        if self.train.eval_every:
            raise ValueError(
                "train.eval_every is a held-out loss; grpo evaluates held-out prompts by their "
                "reward: set grpo.eval_every (and data.heldout) instead"
            )
        if self.grpo.eval_every and not self.data.heldout:
            raise ValueError("grpo.eval_every needs held-out prompts: set data.heldout")

    @property
    def max_prompt_len(self) -> int:
        return self.data.max_seq_len - self.grpo.max_new_tokens

    def require_data(self) -> None:
        if not self.data.path and not self.data.dataset:
            raise ConfigError("data.path (or data.dataset) is not set: name the prompt data")
        if not self.grpo.rewards:
            raise ConfigError(
                "grpo.rewards is empty: add at least one [[grpo.rewards]] entry (kind = "
                "exact_match | numeric_match | regex | length_penalty | python)"
            )
