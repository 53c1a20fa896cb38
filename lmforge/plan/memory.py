"""Memory arithmetic of one training step, per GPU, as lmforge's trainer actually runs it.

Everything here follows the code, not a textbook: `lmforge.train.stage` materializes parameters
in fp32 (frozen LoRA linears in bf16 when training in bf16), `lmforge.train.parallelize`
applies FSDP2 (bf16 all-gathers, reduce-scatters in parallel.reduce_dtype, the last block kept
unsharded after forward) only when the data-parallel size is > 1 or CPU offload is on, and
otherwise the loop runs under bf16 autocast, whose weight cache keeps a bf16 copy of every
trainable matmul weight until the backward pass. The loss
keeps one bf16 logits tensor [b, s, vocab] (fused, `lmforge.modules.cross_entropy`) or, under
tensor parallelism and in DPO, materializes fp32 logits (`lmforge.train.losses`). Activations are counted tensor
by tensor from what autograd saves in `lmforge.models.llama.model` (checked against the saved
tensors of a real model in tests/test_plan.py).

A step's memory peaks in one of a few phases; `plan_memory` evaluates each and reports the
largest. The seed's hand calculation ("18 bytes per parameter: 6 for mixed-precision
parameters, 4 for gradients, 8 for AdamW; 70B × 18 = 1.26e12 bytes = 1.15 TiB") is
`bytes_per_param` and `model_state_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field

from lmforge.errors import ConfigError
from lmforge.models import ModelArgs, family_of
from lmforge.modules.lora import (
    DEFAULT_TARGETS,
    TARGET_MODULES,
    targets_for,
)

GiB = 2**30
TiB = 2**40
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
METHODS = ("pretrain", "full", "lora", "qlora", "dpo-lora", "dpo-full")
AC_MODES = ("none", "selective", "full")
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1}  # sgd: with momentum (one buffer per parameter)
# What a process holds outside torch's caching allocator: the CUDA context with cuBLAS and
# cuDNN handles (0.75 GiB measured on the H200), and NCCL's buffers (0.55 GiB for a one-rank
# group there; more peers take more).
CUDA_CONTEXT_BYTES = 768 * 2**20
NCCL_BYTES = 1024 * 2**20
# Caching-allocator memory reserved beyond the allocated peak. The loss's fp32 [tokens, vocab]
# buffers change shape between forward and backward and the allocator keeps about one more of
# them reserved; under FSDP2 with full activation checkpointing (several CUDA streams, blocks
# recomputed between the loss and the reduce-scatters) about 2.3 of them. Fitted on the H200
# (benchmarks/memory.py, 19 setups; expandable_segments shrinks it without FSDP only), plus a
# few percent of the peak for everything else.
LOSS_BUFFERS_RESERVED = 1.1
LOSS_BUFFERS_RESERVED_FSDP_FULL_AC = 2.3
ALLOCATOR_SLACK = 0.03
NF4_BLOCK = 64  # = lmforge.modules.lora's NF4 block and double-quantization group
NF4_SCALER_BLOCK = 256
FULL_INIT_MAX_PARAMS = 20e9  # = lmforge.train.stage's (not imported: it pulls in DCP)
# Host memory assumed per GPU when none is given: a DGX H100 / H200 node has 2 TiB for 8 GPUs.
HOST_MEMORY_PER_GPU = 256 * GiB
# Known GPUs: memory the device reports (nvidia-smi total), in bytes.
GPU_MEMORY = {
    "h100": 81559 * 2**20,
    "h200": 143771 * 2**20,
    "a100-40gb": 40960 * 2**20,
    "a100-80gb": 81920 * 2**20,
    "l40s": 46068 * 2**20,
    "b200": 183359 * 2**20,
}


# ----------------------------------------------------------------------------- the setup


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything the memory of a training step depends on.

    Defaults are what lmforge's trainer does: fp32 parameters, gradients and AdamW states, bf16
    compute, FSDP2 over every GPU (dp_shard=-1) when there is more than one.
    """

    args: ModelArgs
    model_name: str = ""
    method: str = "full"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = tuple(DEFAULT_TARGETS)
    gpus: int = 1
    gpus_per_node: int = 8
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1  # parallel.ep: stacked experts split over ep of the dp_shard ranks
    activation_checkpointing: str = "none"
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    reduce_dtype: str = "fp32"  # parallel.reduce_dtype (under mixed precision): fp32 | bf16
    compile: bool = False
    micro_batch_size: int = 1
    seq_len: int = 2048
    grad_accumulation: int = 1
    optimizer: str = "adamw"
    param_dtype: str = "fp32"
    compute_dtype: str = "bf16"
    grad_dtype: str | None = None  # None: the parameters' dtype (what torch does)
    optimizer_dtype: str | None = None  # None: the parameters' dtype
    bf16_params: bool | None = None  # optim.bf16_params: None = where the trainer takes it
    dpo_reference: str = "auto"  # auto | adapters_disabled | frozen_copy
    # GRPO (lmforge.train.rollout): G completions of `grpo_prompts` prompts a rollout batch,
    # sampled by the engine with a KV cache of grpo_rollout_batch rows (0: all) × seq_len slots;
    # grpo_generations = 0: not GRPO. grpo_reference: none (beta = 0) | auto | adapters_disabled
    # | frozen_copy.
    grpo_generations: int = 0
    grpo_prompts: int = 8
    grpo_rollout_batch: int = 0
    grpo_reference: str = "none"
    grpo_new_tokens: int = 256  # grpo.max_new_tokens: the positions GRPO's logits cover
    grpo_fuse_rollouts: bool = False  # grpo.fuse_rollouts: fused q/k/v, gate/up copies
    grpo_share_prompts: bool = False  # grpo.share_prompts: a row per prompt, a dense mask
    lora_base_dtype: str = "auto"  # auto | fp32 | bf16: frozen linears' storage (lora.base_dtype)
    document_masking: bool = False
    from_scratch: bool = True  # a preset (fresh init) rather than a checkpoint directory
    force_fsdp: bool = False  # FSDP2 even on one rank (benchmarks/memory.py: the multi-GPU path)

    def replace(self, **changes) -> Setup:
        return dataclasses.replace(self, **changes)

    # ---- derived ---------------------------------------------------------------------
    @property
    def uses_lora(self) -> bool:
        return self.method in ("lora", "qlora", "dpo-lora")

    @property
    def is_dpo(self) -> bool:
        return self.method.startswith("dpo")

    @property
    def is_grpo(self) -> bool:
        return self.grpo_generations > 0

    @property
    def reference(self) -> str | None:
        """DPO's or GRPO's reference model: 'adapters_disabled', 'frozen_copy' or None (not
        DPO, or GRPO without a KL term)."""
        if self.is_grpo:
            chosen = None if self.grpo_reference == "none" else self.grpo_reference
        else:
            chosen = self.dpo_reference if self.is_dpo else None
        if chosen == "auto":
            return "adapters_disabled" if self.uses_lora else "frozen_copy"
        return chosen

    @property
    def rollout_rows(self) -> int:
        """Sequences GRPO's engine decodes at once on each rank (its KV cache rows): its share
        of the prompts, G sequences each, unless grpo.rollout_batch is set."""
        share = max(1, self.grpo_prompts // self.dp_size)
        return self.grpo_rollout_batch or share * self.grpo_generations

    @property
    def num_nodes(self) -> int:
        return max(1, math.ceil(self.gpus / self.gpus_per_node))

    @functools.cached_property
    def mesh(self) -> tuple[int, int, int]:
        """(dp_replicate, dp_shard, tp) as `lmforge.parallel.distributed.mesh_shape` resolves it."""
        from lmforge.parallel.config import ParallelSection
        from lmforge.parallel.distributed import mesh_shape

        section = ParallelSection(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            ep=self.ep,
            compile=self.compile,
            cpu_offload=self.cpu_offload,
        )
        return mesh_shape(section, self.gpus)

    @property
    def dp_size(self) -> int:
        replicate, shard, _ = self.mesh
        return replicate * shard

    @property
    def fsdp(self) -> bool:
        """parallelize() applies FSDP2 when data-parallel size > 1 or CPU offload is on."""
        return self.dp_size > 1 or self.cpu_offload or self.force_fsdp

    @property
    def master_weights(self) -> bool:
        """bf16 trainable weights with their fp32 values (masters) in lmforge's AdamW, as the
        trainer keeps them on one GPU without FSDP or TP, computing in bf16, in full training
        (optim.bf16_params, lmforge.train.adamw)."""
        if self.bf16_params is False or self.uses_lora or self.fsdp or self.tp > 1:
            return False
        return (self.compute_dtype, self.param_dtype, self.optimizer) == ("bf16", "fp32", "adamw")

    @property
    def weight_dtype(self) -> str:
        """dtype the trainable weights are stored in: bf16 with masters, else param_dtype."""
        return "bf16" if self.master_weights else self.param_dtype

    @property
    def autocast(self) -> bool:
        """Without FSDP the loop computes under torch.autocast; with fp32 weights that casts
        every matmul's weight to bf16 (with bf16 weights autocast changes nothing of note)."""
        return (not self.fsdp) and self.compute_dtype != self.weight_dtype

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def frozen_linear_bytes(self) -> int:
        """Bytes per element of a frozen linear weight under LoRA: lora.base_dtype (auto: the
        compute dtype when it is bf16, lmforge.modules.lora.frozen_dtype)."""
        if self.lora_base_dtype == "auto":
            return 2 if self.compute_dtype == "bf16" else self.param_bytes
        return DTYPE_BYTES[self.lora_base_dtype]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.grad_dtype or self.weight_dtype]

    @property
    def optimizer_bytes(self) -> int:
        """The optimizer's bytes a trainable parameter: its states, and the fp32 master."""
        states = OPTIMIZER_STATES[self.optimizer]
        return states * DTYPE_BYTES[self.optimizer_dtype or self.param_dtype] + (
            DTYPE_BYTES[self.param_dtype] if self.master_weights else 0
        )

    @property
    def residual_bytes(self) -> int:
        """dtype of the residual stream: fp32 under autocast (the embedding output is fp32),
        else the compute dtype (FSDP casts the weights, so the embedding output too)."""
        return self.param_bytes if self.autocast else self.compute_bytes

    @property
    def gather_bytes(self) -> int:
        """dtype FSDP2 all-gathers parameters in (its MixedPrecisionPolicy param_dtype)."""
        return self.compute_bytes if self.compute_dtype != self.param_dtype else self.param_bytes

    @property
    def reduce_bytes(self) -> int:
        """dtype FSDP2 reduce-scatters gradients in (parallel.reduce_dtype under mixed
        precision)."""
        if self.compute_dtype == self.param_dtype:
            return self.param_bytes
        return 2 if self.reduce_dtype == "bf16" else 4

    @property
    def sequences(self) -> int:
        """Sequences per forward pass: DPO stacks chosen and rejected into one batch."""
        return self.micro_batch_size * (2 if self.is_dpo else 1)

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    @property
    def mask_bytes(self) -> int:
        """A micro-batch's bool block-causal mask [rows, W, W], shared by the layers: packed
        documents in rows of seq_len, or (grpo.share_prompts) a row per run of one prompt's
        completions in the micro-batch (the most groups a micro-batch can touch), W = the prompt
        once (at most seq_len - C positions) + G completions of C."""
        if self.is_grpo and self.grpo_share_prompts:
            completion = min(self.grpo_new_tokens, self.seq_len - 1)
            width = self.seq_len - completion + self.grpo_generations * completion
            sequences, group = self.micro_batch_size, self.grpo_generations
            # a micro-batch starts at a multiple of gcd(sequences, G) into a group
            rows = -(-(sequences + group - math.gcd(sequences, group)) // group)
            return rows * width**2
        return self.sequences * self.seq_len**2 if self.document_masking else 0

    @property
    def logit_tokens(self) -> int:
        """Positions of a micro-batch whose logits are made: all of them, but GRPO's
        completion tokens only (its forwards project those alone, `logits_at`)."""
        if not self.is_grpo:
            return self.tokens
        return min(self.tokens, self.sequences * min(self.grpo_new_tokens, self.seq_len - 1))

    @property
    def applied_targets(self) -> list[str]:
        """The LoRA targets as the trainer applies them (a MoE's gate / up / down: its experts)."""
        return targets_for(self.lora_targets, moe_model=bool(getattr(self.args, "num_experts", 0)))

    @property
    def adapted(self) -> frozenset[str]:
        """Module attributes (wq, w1, output, ...) carrying LoRA adapters."""
        if not self.uses_lora:
            return frozenset()
        return frozenset(TARGET_MODULES[t] for t in self.applied_targets)


def check_setup(setup: Setup) -> None:
    """Refuse what the trainer refuses, with the same wording (ConfigError)."""
    if setup.method not in METHODS:
        raise ConfigError(f"method {setup.method!r} is not known; allowed: {', '.join(METHODS)}")
    if setup.activation_checkpointing not in AC_MODES:
        raise ConfigError(
            f"activation checkpointing {setup.activation_checkpointing!r}; allowed: "
            + ", ".join(AC_MODES)
        )
    if setup.optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"optimizer {setup.optimizer!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
    for key in ("param_dtype", "compute_dtype", "grad_dtype", "optimizer_dtype"):
        value = getattr(setup, key)
        if value is not None and value not in DTYPE_BYTES:
            raise ConfigError(f"{key} {value!r}; allowed: {', '.join(DTYPE_BYTES)}")
    if setup.gpus < 1:
        raise ConfigError(f"gpus = {setup.gpus} must be >= 1")
    if setup.micro_batch_size < 1 or setup.seq_len < 1:
        raise ConfigError("micro-batch size and sequence length must be >= 1")
    bad = [t for t in setup.lora_targets if t not in TARGET_MODULES]
    if setup.uses_lora and (bad or not setup.lora_targets):
        raise ConfigError(
            f"LoRA targets {list(setup.lora_targets)}: allowed: {', '.join(TARGET_MODULES)}"
        )
    if setup.uses_lora:
        setup.applied_targets  # noqa: B018 (raises ConfigError for a MoE's partial MLP targets)
    if setup.uses_lora and "output" in setup.lora_targets and setup.args.tie_embeddings:
        raise ConfigError(
            "LoRA target 'output' is not supported with tied embeddings; drop 'output'"
        )
    _, _, tp = setup.mesh  # raises the trainer's ConfigError when the degrees do not match
    if tp > 1:
        if setup.args.num_kv_heads % tp:
            raise ConfigError(
                f"parallel.tp = {tp} must divide the model's num_kv_heads "
                f"({setup.args.num_kv_heads})"
            )
        if setup.uses_lora:
            raise ConfigError(
                "lora.enabled with parallel.tp > 1 is not supported; use FSDP (dp_shard)"
            )
    if setup.ep > 1:
        num_experts = getattr(setup.args, "num_experts", 0)
        if not num_experts:
            raise ConfigError(
                f"parallel.ep = {setup.ep} needs a Mixture-of-Experts model (this one has no "
                "experts); set parallel.ep = 1"
            )
        if num_experts % setup.ep:
            allowed = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise ConfigError(
                f"parallel.ep = {setup.ep} must divide the model's num_experts ({num_experts}); "
                f"allowed: {allowed}"
            )
        if setup.method == "qlora":
            raise ConfigError(
                'lora.quantize_base = "nf4" (QLoRA) with parallel.ep > 1 is not supported yet; '
                "set parallel.ep = 1, or train LoRA with bf16 bases"
            )
    if setup.method == "qlora" and setup.cpu_offload:
        raise ConfigError('lora.quantize_base = "nf4" (QLoRA) cannot be combined with CPU offload')
    if setup.reference == "adapters_disabled" and not setup.uses_lora:
        key = "grpo.reference" if setup.is_grpo else "dpo.reference"
        raise ConfigError(f'{key} = "adapters_disabled" needs lora.enabled = true')
    if setup.is_grpo and setup.cpu_offload:
        raise ConfigError("lmforge grpo cannot use parallel.cpu_offload")


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the model names it (without the checkpoint wrapper's prefix)."""

    name: str
    shape: tuple[int, ...]
    group: str  # FSDP unit: "root" or "layers.N"
    tp_dim: int | None  # dimension tensor parallelism splits; None: replicated over tp
    trainable: bool
    nf4: bool = False  # stored as NF4 (QLoRA's frozen bases of adapted linears)
    matmul: bool = False  # used as a matmul weight (cast to the compute dtype)
    frozen_linear: bool = False  # a linear's weight frozen by LoRA (stored in lora.base_dtype)
    expert: bool = False  # stacked experts [E, ...]: parallel.ep splits dim 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_specs(setup: Setup, *, num_layers: int | None = None) -> list[ParamSpec]:
    """Every parameter of the (LoRA-swapped) model, with how parallelize() splits it
    (`num_layers`: only the first blocks; they are all alike)."""
    a = setup.args
    d = a.dim
    adapted = setup.adapted
    full = not setup.uses_lora
    r = setup.lora_rank
    specs = [
        ParamSpec(
            "tok_embeddings.weight", (a.vocab_size, d), "root", 0, full, matmul=a.tie_embeddings
        )
    ]

    def linear(prefix: str, attr: str, shape: tuple[int, int], tp_dim: int, group: str):
        is_adapted = attr in adapted
        specs.append(
            ParamSpec(
                f"{prefix}{attr}.weight",
                shape,
                group,
                tp_dim,
                full,
                nf4=is_adapted and setup.method == "qlora",
                matmul=True,
                frozen_linear=not full,
            )
        )
        if is_adapted:
            specs.append(
                ParamSpec(
                    f"{prefix}{attr}.lora_a.weight", (r, shape[1]), group, None, True, matmul=True
                )
            )
            specs.append(
                ParamSpec(
                    f"{prefix}{attr}.lora_b.weight", (shape[0], r), group, None, True, matmul=True
                )
            )

    block_params = family_of(a).block_params  # the family's shapes, e.g. attention.wq.weight
    for i in range(a.num_layers if num_layers is None else num_layers):
        group = f"layers.{i}"
        for param in block_params(a, i):  # a MoE family's sparse and dense blocks differ
            if param.kind == "linear":
                prefix = f"{group}.{param.name.removesuffix(param.attribute + '.weight')}"
                linear(prefix, param.attribute, param.shape, param.tp_dim, group)
            else:  # stacked experts [E, out, in] (LoRA target "experts"), norms
                is_adapted = param.kind == "experts" and "experts" in adapted
                specs.append(
                    ParamSpec(
                        f"{group}.{param.name}",
                        param.shape,
                        group,
                        param.tp_dim,
                        full,
                        nf4=is_adapted and setup.method == "qlora",
                        matmul=param.kind == "experts",
                        expert=param.kind == "experts",
                        frozen_linear=not full and param.kind == "experts",
                    )
                )
                if is_adapted:  # lora.py's LoRAExperts: A [E, r, in], B [E, out, r]
                    e, out_dim, in_dim = param.shape
                    prefix, _, stack = param.name.rpartition(".")
                    for which, shape in (("lora_a", (e, r, in_dim)), ("lora_b", (e, out_dim, r))):
                        specs.append(
                            ParamSpec(
                                f"{group}.{prefix}.{which}.{stack}",
                                shape,
                                group,
                                None,
                                True,
                                matmul=True,
                                expert=True,  # [E, ...]: split with its experts under ep
                            )
                        )
    specs.append(ParamSpec("norm.weight", (d,), "root", None, full))
    if not a.tie_embeddings:  # tied: the output projection *is* tok_embeddings.weight
        linear("", "output", (a.vocab_size, d), 0, "root")
    return specs


def _model_parallel_shape(spec: ParamSpec, setup: Setup) -> list[int]:
    """The parameter as one rank holds it with FSDP's shards gathered: tensor parallelism splits
    `tp_dim` (torch.chunk, so rank 0 gets the ceiling); expert parallelism keeps E / ep of the
    stacked experts (`lmforge.parallel.expert_parallel`)."""
    _, _, tp = setup.mesh
    shape = list(spec.shape)
    if tp > 1 and spec.tp_dim is not None:
        shape[spec.tp_dim] = math.ceil(shape[spec.tp_dim] / tp)
    if spec.expert and setup.ep > 1:
        shape[0] //= setup.ep
    return shape


def local_shape(spec: ParamSpec, setup: Setup) -> tuple[int, ...]:
    """Shape of rank 0's shard: `_model_parallel_shape`, then FSDP2 splits dim 0 of that over
    dp_shard (padded to the same size on every rank, which rank 0's chunk equals); an expert-
    parallel rank's experts over the dp_shard / ep ranks that hold the same ones."""
    _, dp_shard, _ = setup.mesh
    shape = _model_parallel_shape(spec, setup)
    if spec.expert and setup.ep > 1:
        dp_shard //= setup.ep
    if setup.fsdp and dp_shard > 1:
        shape[0] = math.ceil(shape[0] / dp_shard)
    return tuple(shape)


def tp_local_numel(spec: ParamSpec, setup: Setup) -> int:
    """Elements one rank holds when FSDP has gathered the parameter (TP and EP shards only)."""
    return math.prod(_model_parallel_shape(spec, setup))


def nf4_bytes(numel: int, meta_bytes: int = 4) -> int:
    """Bytes of torchao's NF4Tensor: 4-bit codes, an int8 scale per 64 values, a factor per
    group of scales (double quantization), the mean and the 16-entry code table; those last
    three in the dtype of the weight it quantized (`meta_bytes` a value)."""
    blocks = numel // NF4_BLOCK
    scaler_block = math.gcd(NF4_SCALER_BLOCK, blocks) or 1
    return numel // 2 + blocks + meta_bytes * (blocks // scaler_block + 1 + 16)


def parameter_bytes(spec: ParamSpec, setup: Setup, numel: int | None = None) -> int:
    numel = math.prod(local_shape(spec, setup)) if numel is None else numel
    if spec.nf4:  # quantized from the weight as stored (lora.base_dtype)
        return nf4_bytes(numel, setup.frozen_linear_bytes)
    return numel * (setup.frozen_linear_bytes if spec.frozen_linear else setup.param_bytes)


# ----------------------------------------------------------------------------- bytes/param


def bytes_per_param(setup: Setup) -> dict[str, int]:
    """The seed's convention for a trainable parameter, unsharded: parameters (storage plus
    the compute-dtype copy when they differ), gradients, optimizer states.
    Mixed-precision AdamW: {parameters: 6, gradients: 4, optimizer states: 8} = 18; with bf16
    weights and fp32 masters (`Setup.master_weights`): {2, 2, 12} = 16."""
    params = setup.param_bytes
    if setup.compute_dtype != setup.weight_dtype:
        params += setup.compute_bytes
    return {
        "parameters": params,
        "gradients": setup.grad_bytes,
        "optimizer states": setup.optimizer_bytes,
    }


def model_state_bytes(setup: Setup, num_params: float | None = None) -> int:
    """Parameters + gradients + optimizer states of the whole model, unsharded, before
    activations. For full training that is bytes_per_param × parameters; with LoRA, frozen
    weights count only their storage. `num_params` replaces the model's exact count (the seed
    used 70e9 for Llama 3 70B)."""
    per = sum(bytes_per_param(setup).values())
    if not setup.uses_lora:
        count = setup.args.num_params() if num_params is None else num_params
        return round(count * per)
    specs = param_specs(setup)
    total = 0
    for spec in specs:
        if spec.trainable:
            total += spec.numel * per
        else:
            total += parameter_bytes(spec, setup, spec.numel)
    return total


# ----------------------------------------------------------------------------- activations


def _inputs_saved(setup: Setup, *, width: int, x_bytes: int, consumers, already_saved: bool) -> int:
    """Bytes per token that the linears reading one activation x [tokens, width] save for
    backward. consumers: (base_saves_input, has_adapter) per linear. A trainable base saves
    its input; a frozen one does not. LoRA's A saves its input. Under autocast every linear
    casts x to bf16 itself (a new copy each), unless x already is bf16."""
    c = setup.compute_bytes
    if setup.autocast:
        shared, copies = False, 0
        for base_saves, has_adapter in consumers:
            if base_saves:
                if x_bytes == c:
                    shared = True
                else:
                    copies += 1
            if has_adapter:
                copies += 1  # x.to(adapter dtype fp32) then autocast's own bf16 copy
        return copies * c * width + (x_bytes * width if shared and not already_saved else 0)
    if any(base or adapter for base, adapter in consumers) and not already_saved:
        return x_bytes * width
    return 0


def layer_activations(setup: Setup) -> dict[str, float]:
    """Bytes per token that one transformer block saves for backward without activation
    checkpointing, by part. Under tensor parallelism (sequence parallel) the norms work on
    1/tp of the sequence and the heads / MLP columns are split, while the all-gathered inputs
    of the column-parallel projections are whole."""
    a = setup.args
    d, f, h = a.dim, a.ffn_dim, a.num_heads
    qd, kvd = a.q_dim, a.kv_dim
    c, rb = setup.compute_bytes, setup.residual_bytes
    _, _, tp = setup.mesh
    full = not setup.uses_lora
    adapted = setup.adapted
    r = setup.lora_rank

    def consumers(*attrs):
        return [(full, attr in adapted) for attr in attrs]

    # RMSNorm: the fp32 input (pow / mul save it), 1/rms (fp32), and the normalized x for the
    # weight's gradient (only when the norm weight trains).
    norm = 4 * d + 4 + (rb * d if full else 0)
    parts = {
        "norms": 2 * norm / tp,
        "attention inputs": _inputs_saved(
            setup, width=d, x_bytes=rb, consumers=consumers("wq", "wk", "wv"), already_saved=False
        ),
        # SDPA (flash / memory-efficient) saves q, k, v (kv heads: GQA is native), the output
        # and the fp32 log-sum-exp; its output is laid out [b, s, h, hd], so wo's input is a
        # view of it.
        "attention": (c * (2 * qd + 2 * kvd) + 4 * h) / tp,
        "attention output input": _inputs_saved(
            setup, width=qd, x_bytes=c, consumers=consumers("wo"), already_saved=True
        )
        / tp,
    }
    sparse = sparse_share(a)
    if sparse < 1:
        dense = {
            "MLP inputs": _inputs_saved(
                setup, width=d, x_bytes=rb, consumers=consumers("w1", "w3"), already_saved=False
            ),
            # silu saves its input (gate), the product saves silu(gate) and up.
            "MLP": 3 * c * f / tp,
            "MLP down input": _inputs_saved(
                setup, width=f, x_bytes=c, consumers=consumers("w2"), already_saved=False
            )
            / tp,
        }
        parts |= {name: (1 - sparse) * size for name, size in dense.items()}
    if sparse > 0:
        parts |= {name: sparse * size for name, size in _moe_activations(setup).items()}
    head_norms = _head_norm_activations(setup)
    if head_norms:
        parts["q/k head norms"] = head_norms
    lora_outputs = sum(c * r for attr in ("wq", "wk", "wv", "wo") if attr in adapted)
    lora_outputs += (1 - sparse) * sum(c * r for attr in ("w1", "w2", "w3") if attr in adapted)
    if lora_outputs:
        parts["LoRA A outputs"] = lora_outputs
    return parts


def sparse_share(args) -> float:
    """The share of the blocks whose MLP is a Mixture of Experts (0 for dense families)."""
    return len(getattr(args, "moe_layers", ())) / args.num_layers


def _moe_activations(setup: Setup) -> dict[str, float]:
    """Bytes per token that a sparse block's MLP (models/moe.py's grouped path) saves for
    backward: the router's input, fp32 softmax and top-k; each token's k rows sorted by expert
    (the products' inputs), the SwiGLU's gate / up and output, the rows back in token order for
    the weighted sum (one batched product), and the indices of both permutations. The loss step
    adds the router logits the layer keeps and the aux loss's own fp32 softmax."""
    a = setup.args
    d, k, e, i = a.dim, a.num_experts_per_tok, a.num_experts, a.moe_ffn_dim
    c, rb = setup.compute_bytes, setup.residual_bytes
    full = not setup.uses_lora
    adapted = "experts" in setup.adapted
    rows_saved = full or adapted  # the grouped products' inputs (weight gradient, adapters' A)
    parts = {
        "MLP inputs": _inputs_saved(
            setup,
            width=d,
            x_bytes=rb,
            consumers=[(full, "router" in setup.adapted)],
            already_saved=False,
        ),
        # softmax's fp32 output, top-k's indices, the renormalization's division (its input
        # and the sum)
        "router": 4 * e + 8 * k + (4 * k + 4 if a.norm_topk_prob else 0),
        # the logits [E] the layer keeps for the loss step's aux loss, whose softmax saves its
        # fp32 probabilities and its top-k the indices
        "aux loss": c * e + 4 * e + 8 * k,
        "expert rows": c * k * d if rows_saved else 0,
        # silu saves gate (a view of gate_up), the product silu(gate) and up
        "experts": 3 * c * k * i,
        "experts down input": c * k * i if rows_saved else 0,
        # the weighted sum's rows [k, dim] and weights [k]; the two gathers' int64 indices
        "experts combine": c * k * d + c * k + 2 * 8 * k,
    }
    if adapted:
        parts["experts LoRA A outputs"] = 2 * c * k * setup.lora_rank
    if "router" in setup.adapted:
        parts["router LoRA A output"] = c * setup.lora_rank
    return parts


def _head_norm_activations(setup: Setup) -> float:
    """Bytes per token the RMSNorms over each query / key head save (Qwen3): like the block
    norms, the fp32 input and 1/rms per head, and the normalized heads in the compute dtype
    for the weight's gradient; their input is the projection's output [tokens, width]."""
    a = setup.args
    c = setup.compute_bytes
    _, _, tp = setup.mesh
    widths = {"wq": a.q_dim, "wk": a.kv_dim}
    total = 0
    for param in family_of(a).block_params(a):
        if param.kind == "head_norm":
            width = widths[param.reads]
            heads = width // a.head_dim
            total += 4 * width + 4 * heads + (c * width if not setup.uses_lora else 0)
    return total / tp


def compiled_layer_activations(setup: Setup) -> float:
    """Estimate for a torch.compile'd block (Inductor's partitioner recomputes pointwise ops):
    block input, the residual after attention, the projection inputs, q/k/v/out/lse, and the
    MLP's gate, up and product."""
    a = setup.args
    d, f, h = a.dim, a.ffn_dim, a.num_heads
    qd, kvd = a.q_dim, a.kv_dim
    c, rb = setup.compute_bytes, setup.residual_bytes
    _, _, tp = setup.mesh
    return (2 * rb * d + 8) / tp + 2 * c * d + (c * (2 * qd + 2 * kvd) + 4 * h + 3 * c * f) / tp


def _mm_outputs(setup: Setup, *, sparse: bool = False) -> list[float]:
    """Bytes per token of each aten.mm output of a block's forward, in execution order
    (selective checkpointing counts them). LoRA adds A and B after each adapted base matmul.
    A sparse block's MLP has one: its router's logits (the experts' products are grouped,
    not aten.mm, and recomputed)."""
    a = setup.args
    c = setup.compute_bytes
    _, _, tp = setup.mesh
    kvd = a.num_kv_heads * a.head_dim
    r = setup.lora_rank
    mlp = (
        [("router", a.num_experts, False)]  # replicated under TP: whole
        if sparse
        else [("w1", a.ffn_dim, True), ("w3", a.ffn_dim, True), ("w2", a.dim, False)]
    )
    out = []
    for attr, width, column in (
        ("wq", a.num_heads * a.head_dim, True),
        ("wk", kvd, True),
        ("wv", kvd, True),
        ("wo", a.dim, False),
        *mlp,
    ):
        out.append(c * width / tp if column else c * width)  # row-parallel: partial sums, whole
        if attr in setup.adapted:
            out += [c * r, c * width]
    return out


def _selective_kept(setup: Setup) -> float:
    """Bytes per token of the mm outputs selective checkpointing keeps (every second), over
    the dense and sparse blocks in their shares."""
    share = sparse_share(setup.args)

    def kept(sparse: bool) -> float:
        outputs = _mm_outputs(setup, sparse=sparse)
        return sum(size for i, size in enumerate(outputs, start=1) if i % 2 == 0)

    return (1 - share) * kept(False) + (share * kept(True) if share else 0)


def saved_per_layer(setup: Setup) -> float:
    """Bytes per token one block holds from its forward until its backward."""
    a = setup.args
    _, _, tp = setup.mesh
    block_input = setup.residual_bytes * a.dim / tp
    mode = setup.activation_checkpointing
    if mode == "full":
        return block_input  # checkpoint_wrapper keeps only the block's inputs
    if mode == "selective":
        kept = _selective_kept(setup)
        sdpa = (setup.compute_bytes * a.q_dim + 4 * a.num_heads) / tp
        return block_input + kept + sdpa
    if setup.compile:
        return compiled_layer_activations(setup)
    return sum(layer_activations(setup).values())


def head_activations(setup: Setup) -> float:
    """Bytes per token saved outside the blocks: the final norm, the output projection's
    input, the embedding's indices and the batch itself."""
    a = setup.args
    d = a.dim
    _, _, tp = setup.mesh
    full = not setup.uses_lora
    norm = (4 * d + 4 + (setup.residual_bytes * d if full else 0)) / tp
    out_input = _inputs_saved(
        setup,
        width=d,
        x_bytes=setup.residual_bytes,
        consumers=[(full, "output" in setup.adapted)],
        already_saved=False,
    )
    return norm + out_input + (8 if full else 0) + 16


# Values of the fp32 temporaries of GRPO's log-probabilities at once (its chunk of rows of the
# logits: `lmforge.train.grpo_loss.CHUNK_VALUES`): four in the forward (the logits in fp32,
# their log-softmax, its exp and their product), three in the backward
GRPO_LOSS_CHUNK = 2**26


def loss_bytes(setup: Setup) -> tuple[int, int]:
    """(forward, backward) peak bytes of logits and loss for one micro-batch.

    Eager cross entropy: bf16 logits, their fp32 copy and log_softmax's fp32 output in the
    forward; in the backward nll's dense fp32 gradient, the saved log-probabilities and
    log_softmax's fp32 gradient: 12 bytes per vocabulary entry. DPO's reference forward runs
    while the policy's log-probabilities wait for backward (4 + 10). A compiled loss keeps the
    bf16 logits and writes a bf16 gradient. The fused loss of GPUs without tensor parallelism
    (`lmforge.modules.cross_entropy`) writes the gradient over the logits in the forward: one
    tensor of logits in both. GRPO keeps its bf16 logits and makes their log-probabilities a
    chunk of rows at a time (`lmforge.train.grpo_loss.PickedLogProbs`), then their gradient.
    Logits are whole on every tensor-parallel rank."""
    v = setup.args.vocab_size
    c = setup.compute_bytes
    upcast = 4 if c != 4 else 0
    per_token_fwd = (c + upcast + 4) * v
    per_token_bwd = 12 * v
    if setup.is_dpo:
        per_token_fwd = 4 * v + (c + upcast + 4) * v
    elif setup.is_grpo:  # the logits kept, and a chunk of rows' fp32 temporaries at a time
        chunk = min(setup.logit_tokens * v, GRPO_LOSS_CHUNK)
        kept = c * v * setup.logit_tokens
        return kept + 16 * chunk, 2 * kept + 12 * chunk  # (+ the gradient of the logits)
    elif setup.tp == 1:
        per_token_fwd = per_token_bwd = c * v
    elif setup.compile:
        per_token_fwd, per_token_bwd = c * v, 2 * c * v
    return per_token_fwd * setup.logit_tokens, per_token_bwd * setup.logit_tokens


# ----------------------------------------------------------------------------- the plan


@dataclass
class PhasedMemory:
    """Per-GPU memory as phases of live components (bytes by name), the peak phase, and
    what comes on top of allocated memory; training and inference plans both are one."""

    phases: dict[str, dict[str, int]]
    peak_phase: str
    overhead: int  # context, NCCL and allocator slack
    gpu_memory: int | None

    @property
    def peak_allocated(self) -> int:
        """What torch.cuda.max_memory_allocated() should report."""
        return sum(self.phases[self.peak_phase].values())

    @property
    def total(self) -> int:
        """Device memory needed: the allocated peak plus context, NCCL and allocator slack."""
        return self.peak_allocated + self.overhead

    @property
    def gpu_fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.total <= self.gpu_memory


@dataclass(kw_only=True)
class Plan(PhasedMemory):
    """Per-GPU memory of one training step: each phase's live components, the peak, the
    verdict."""

    setup: Setup
    host: dict[str, int]  # per GPU process, on the host
    labels: dict[str, str]
    notes: list[str] = field(default_factory=list)
    load_host_bytes: int = 0  # rank 0's host memory while loading the starting weights
    host_memory: int | None = None  # per node
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def host_total(self) -> int:
        """Host memory one GPU process needs (CPU offload)."""
        return sum(self.host.values())

    @property
    def host_per_node(self) -> int:
        """Host memory the first node needs: its processes' offloaded state, plus the full
        starting weights rank 0 holds while loading them."""
        return (
            self.host_total * min(self.setup.gpus, self.setup.gpus_per_node) + self.load_host_bytes
        )

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_memory is None else self.host_per_node <= self.host_memory

    @property
    def fits(self) -> bool | None:
        if self.gpu_memory is None:
            return None
        return bool(self.gpu_fits and self.host_fits is not False)

    def largest(self, component: str) -> int:
        return max(phase.get(component, 0) for phase in self.phases.values())


@dataclass
class Suggestion:
    change: str  # what to change, as flags
    plan: Plan
    cost: float  # relative GPU-hours (step-time multiplier × GPU-count ratio)
    note: str = ""


COMPONENT_ORDER = (
    "parameters",
    "gradients",
    "optimizer states",
    "reference model",
    "weight copies",
    "gradient buffers",
    "activations",
    "logits and loss",
    "backward workspace",
    "rollout replica",
    "KV cache",
    "rollout logits",
)


def _group_numels(specs: list[ParamSpec], setup: Setup) -> dict[str, dict[str, int]]:
    """Per FSDP unit: TP-local element counts (all, trainable, matmul trainable/frozen)."""
    groups: dict[str, dict[str, int]] = {}
    for spec in specs:
        g = groups.setdefault(
            "root" if spec.group == "root" else "block",
            {"all": 0, "trainable": 0, "matmul_trainable": 0, "matmul_frozen": 0, "nf4": 0},
        )
        n = tp_local_numel(spec, setup)
        g["all"] += n
        if spec.trainable:
            g["trainable"] += n
        if spec.matmul and spec.trainable:
            g["matmul_trainable"] += n
        stored_for_compute = spec.frozen_linear and setup.frozen_linear_bytes == setup.compute_bytes
        if spec.matmul and not spec.trainable and not spec.nf4 and not stored_for_compute:
            g["matmul_frozen"] += n  # frozen weights that autocast casts at each use
        if spec.nf4:
            g["nf4"] += n
    return groups


@dataclass(frozen=True)
class _ModelState:
    """Per-GPU persistent state (sharded when FSDP is on; moved to the host by CPU offload)."""

    persistent: dict[str, int]  # parameters, optimizer states, reference model on the GPU
    grads: int  # gradients on the GPU
    host: dict[str, int]  # what CPU offload keeps on the host instead


@dataclass(frozen=True)
class _StepActivations:
    """Bytes one micro-batch's forward and backward add to the persistent state."""

    saved: int  # what the forward saves for backward, all blocks, outside them, RoPE, mask
    one_block: int  # the last block's saved tensors (at the end of the backward)
    recompute: int  # one block's forward again under activation checkpointing
    workspace: int  # one block's activation gradients
    loss_fwd: int
    loss_bwd: int
    nf4_transient: int  # QLoRA: one dequantized base weight at a time


def _model_state(setup: Setup, specs: list[ParamSpec]) -> _ModelState:
    """Parameters, gradients, optimizer states and DPO's frozen reference, per GPU."""
    num_layers = setup.args.num_layers

    def per_model(values):  # root parameters once, block parameters num_layers times
        return sum(v * (1 if spec.group == "root" else num_layers) for spec, v in values)

    params = per_model((s, parameter_bytes(s, setup)) for s in specs)
    trainable_local = per_model((s, math.prod(local_shape(s, setup))) for s in specs if s.trainable)
    grads = trainable_local * setup.grad_bytes
    optim = trainable_local * setup.optimizer_bytes
    reference = 0
    if setup.reference == "frozen_copy":
        base = setup.replace(method="full")  # the same model without adapters
        reference = per_model(
            (s, parameter_bytes(s, base)) for s in param_specs(base, num_layers=1)
        )
    host = {}
    if setup.cpu_offload:
        host = {"parameters": params, "gradients": grads, "optimizer states": optim}
        if reference:
            host["reference model"] = reference
        params = grads = optim = reference = 0
    persistent = {"parameters": params, "optimizer states": optim, "reference model": reference}
    return _ModelState(persistent=persistent, grads=grads, host=host)


def _step_activations(setup: Setup, specs: list[ParamSpec]) -> _StepActivations:
    a = setup.args
    tokens = setup.tokens
    per_layer = saved_per_layer(setup)
    # + RoPE's cos and sin [1, s, head_dim], shared by the layers (the residual's dtype).
    rope = 2 * setup.seq_len * a.head_dim * setup.residual_bytes
    saved = int(tokens * (a.num_layers * per_layer + head_activations(setup))) + rope
    saved += setup.mask_bytes
    no_ac = setup.replace(activation_checkpointing="none")
    one_layer = int(tokens * sum(layer_activations(no_ac).values()))
    d, f, qd, kvd = a.dim, a.ffn_dim, a.q_dim, a.kv_dim
    c, rb = setup.compute_bytes, setup.residual_bytes
    _, _, tp = setup.mesh
    mlp = 3 * c * f if sparse_share(a) < 1 else 0  # gate, up and their product's gradients
    if sparse_share(a):  # a sparse MLP's: those of its k rows, and the rows' own [k, dim]
        mlp = max(mlp, c * a.num_experts_per_tok * (3 * a.moe_ffn_dim + 2 * d))
    workspace_per_token = (
        max(mlp, 4 * qd + c * (2 * qd + 2 * kvd)) + 2 * rb * d
    ) / tp  # activation gradients of one block (MLP, or flash's fp32 dq accumulator)
    loss_fwd, loss_bwd = loss_bytes(setup)
    nf4_transient = 0
    if setup.method == "qlora":
        largest = max((tp_local_numel(s, setup) for s in specs if s.nf4), default=0)
        nf4_transient = 6 * largest  # dequantized fp32 weight + its bf16 cast, one at a time
    return _StepActivations(
        saved=saved,
        one_block=int(tokens * per_layer),
        recompute=one_layer if setup.activation_checkpointing != "none" else 0,
        workspace=int(tokens * workspace_per_token),
        loss_fwd=loss_fwd,
        loss_bwd=loss_bwd,
        nf4_transient=nf4_transient,
    )


def _fsdp_phases(
    setup: Setup, groups: dict[str, dict[str, int]], state: _ModelState, acts: _StepActivations
) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Phases under FSDP2: weights gathered a block at a time (in the compute dtype), gradients
    reduce-scattered after every micro-batch, so earlier micro-batches' gradients are shards."""
    root, block = groups["root"], groups["block"]
    persistent, grads = state.persistent, state.grads
    grad_acc = grads if setup.grad_accumulation > 1 else 0
    gb, redb = setup.gather_bytes, setup.reduce_bytes
    labels = {
        "weight copies": f"{dtype_name(gb)} weights gathered by FSDP (unsharded)",
        "gradient buffers": "unsharded gradients + reduce-scatter buffers",
    }
    blk, rt = block["all"] * gb, root["all"] * gb
    if setup.reshard_after_forward:
        gathered_fwd = blk  # the last block stays gathered for backward
        gathered_bwd = rt + 2 * blk  # root (re-gathered) + current + prefetched block
    else:
        gathered_fwd = gathered_bwd = rt + setup.args.num_layers * blk
    if setup.reference == "frozen_copy":
        gathered_fwd += blk  # the reference's last block stays gathered (no backward)
        gathered_bwd += blk
    grad_buffers_bwd = (
        block["trainable"] * (gb + redb)  # this block's gradients + its reduce-scatter input
        + root["trainable"] * gb  # the output projection's gradient, held to the end
    )

    def forward_phase(weight_copies: int, logits: int) -> dict[str, int]:
        return {
            **persistent,
            "gradients": grad_acc,
            "weight copies": weight_copies,
            "activations": acts.saved,
            "logits and loss": logits,
        }

    logits = setup.compute_bytes * setup.args.vocab_size * setup.logit_tokens
    phases = {
        # the root is gathered until the forward returns
        "output projection": forward_phase(rt + gathered_fwd, logits),
        "forward end (loss)": forward_phase(gathered_fwd, acts.loss_fwd),
        "loss backward": forward_phase(gathered_fwd, acts.loss_bwd),
        "blocks backward": {
            **persistent,
            "gradients": grads,
            "weight copies": gathered_bwd,
            "gradient buffers": grad_buffers_bwd,
            "activations": acts.saved,
            "backward workspace": acts.recompute + acts.workspace,
        },
        "last reduce-scatter": {
            **persistent,
            "gradients": grads,
            "gradient buffers": root["trainable"] * (gb + redb),
        },
    }
    return phases, labels


def _local_phases(
    setup: Setup, groups: dict[str, dict[str, int]], state: _ModelState, acts: _StepActivations
) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Phases without FSDP (one rank, or TP only): under autocast the loop caches a compute-dtype
    copy of every trainable matmul weight for the whole forward."""
    root, block = groups["root"], groups["block"]
    persistent, grads = state.persistent, state.grads
    num_layers = setup.args.num_layers
    # Accumulating, the gradients of the step's earlier micro-batches are held through the next
    # one; bf16 weights hold them as fp32 sums beside the micro-batch's own bf16 gradients.
    grad_acc = 0
    if setup.grad_accumulation > 1:
        grad_acc = grads // setup.grad_bytes * 4 if setup.master_weights else grads
    sums = grad_acc if setup.master_weights else 0
    output_matmul = root["matmul_trainable"]  # the output projection (or the tied table)
    output_frozen = root["matmul_frozen"]
    cb = setup.compute_bytes
    labels = {
        "weight copies": (
            f"{dtype_name(cb)} weight copies (autocast)" if setup.autocast else "weight copies"
        ),
        "gradient buffers": "gradient buffers",
    }
    if setup.autocast:
        # Without checkpointing each cached copy is also saved for backward. Frozen weights
        # are cast at each use and saved only when the block is not checkpointed.
        trainable_copies = (num_layers * block["matmul_trainable"] + output_matmul) * cb
        frozen_copies = (num_layers * block["matmul_frozen"] + output_frozen) * cb
        if setup.activation_checkpointing == "none":
            copies_fwd = copies_bwd = trainable_copies + frozen_copies
        else:
            copies_fwd = trainable_copies + output_frozen * cb
            copies_bwd = (output_matmul + output_frozen) * cb  # the output layer's only
        layer_copies = (block["matmul_trainable"] + block["matmul_frozen"]) * cb
    else:
        copies_fwd = copies_bwd = layer_copies = 0
    layer_grads = block["trainable"] * (cb if setup.autocast else 0)
    block_workspace = acts.recompute + acts.workspace + layer_grads
    recomputing = acts.recompute > 0
    phases = {
        "forward end (loss)": {
            **persistent,
            "gradients": grad_acc,
            "weight copies": copies_fwd,
            "activations": acts.saved,
            "logits and loss": acts.loss_fwd,
            "backward workspace": acts.nf4_transient,
        },
        "loss backward": {
            **persistent,
            "gradients": grad_acc,
            "weight copies": copies_bwd,
            "activations": acts.saved,
            "logits and loss": acts.loss_bwd,
        },
        "blocks backward": {
            **persistent,
            "gradients": sums + root["trainable"] * setup.grad_bytes
            if sums
            else max(grad_acc, root["trainable"] * setup.grad_bytes),
            "weight copies": max(copies_bwd, layer_copies) if recomputing else copies_bwd,
            "activations": acts.saved,
            "backward workspace": block_workspace + acts.nf4_transient,
        },
        "backward end": {
            **persistent,
            "gradients": grads + sums,
            "weight copies": layer_copies,
            "activations": acts.one_block,
            "backward workspace": block_workspace,
        },
    }
    return phases, labels


def kv_cache_bytes(setup: Setup) -> int:
    """GRPO's engine cache: K and V of every layer, rollout_rows × seq_len slots, in the dtype
    the trainer computes in (lmforge.train.rollout); a tensor-parallel rank holds its share of
    the heads."""
    a = setup.args
    slots = setup.rollout_rows * setup.seq_len
    return 2 * a.num_layers * slots * (a.kv_dim // setup.mesh[2]) * setup.compute_bytes


def replica_bytes(setup: Setup) -> int:
    """The weights GRPO's engine samples from beside the policy's (lmforge.train.replica):
    none in one process (but the fused q/k/v and gate/up copies of grpo.fuse_rollouts), or
    under tensor parallelism alone with weights stored as they are computed (the policy's own
    tensors); else a copy of each rank's tensor-parallel shard (FSDP: gathered), in the compute
    dtype when that is bf16 (QLoRA's bases in NF4), else as the trainer stores the weights."""
    copies = setup.fsdp or (setup.tp > 1 and setup.param_bytes != setup.compute_bytes)
    if not copies:
        if setup.tp == 1 and setup.grpo_fuse_rollouts and not setup.uses_lora:
            fused = ("wq", "wk", "wv", "w1", "w3")  # copies in the weights' dtype
            specs = param_specs(setup)
            return sum(s.numel * setup.param_bytes for s in specs if s.name.split(".")[-2] in fused)
        return 0
    bf16 = setup.compute_dtype == "bf16"
    total = 0
    for spec in param_specs(setup):
        numel = tp_local_numel(spec, setup)
        if spec.nf4 and bf16:
            total += nf4_bytes(numel, 2)
        else:
            total += numel * 2 if bf16 else parameter_bytes(spec, setup, numel)
    return total


def _rollout_phases(setup: Setup, state: _ModelState) -> dict[str, dict[str, int]]:
    """GRPO's phases outside the update: the engine sampling (its KV cache and each decode
    step's fp32 logits and log-probabilities over every row), then the no-grad forwards that
    score the rollouts (old and reference log-probabilities: the logits, and a chunk of rows'
    fp32 temporaries at a time, counted as the loss step's, which also makes the entropy).
    Gradients are freed before a rollout starts."""
    v = setup.args.vocab_size
    scoring, _ = loss_bytes(setup)
    return {
        "rollout (engine)": {
            **state.persistent,
            "rollout replica": replica_bytes(setup),
            "KV cache": kv_cache_bytes(setup),
            "rollout logits": 2 * 4 * v * setup.rollout_rows,
        },
        "rollout scoring": {**state.persistent, "logits and loss": scoring},
    }


def _overhead(setup: Setup, peak: int) -> int:
    """Device memory beyond the allocated peak: CUDA context, NCCL, the caching allocator's
    reserve (about one more fp32 loss buffer, more under FSDP with full checkpointing)."""
    overhead = CUDA_CONTEXT_BYTES + (NCCL_BYTES if setup.gpus > 1 or setup.fsdp else 0)
    eager_loss = setup.is_dpo or setup.is_grpo or not setup.compile
    loss_buffer = 4 * setup.args.vocab_size * setup.logit_tokens if eager_loss else 0
    kept = (
        LOSS_BUFFERS_RESERVED_FSDP_FULL_AC
        if setup.fsdp and setup.activation_checkpointing == "full"
        else LOSS_BUFFERS_RESERVED
    )
    return overhead + int(ALLOCATOR_SLACK * peak + kept * loss_buffer)


def _notes(setup: Setup) -> list[str]:
    """What the plan assumes that the user should know: what-ifs the trainer does not run."""
    notes = []
    if setup.optimizer != "adamw":
        notes.append("lmforge's trainer builds AdamW; other optimizers are a what-if here")
    if {setup.param_dtype, setup.grad_dtype or "fp32", setup.optimizer_dtype or "fp32"} != {"fp32"}:
        notes.append(
            "lmforge's trainer keeps parameters (or, on one GPU, the masters of bf16 weights), "
            "gradients and optimizer states in fp32; other precisions are a what-if here"
        )
    if setup.master_weights:
        notes.append(
            "one GPU: bf16 weights and gradients, the optimizer holding fp32 masters "
            "(optim.bf16_params; false: fp32 weights under autocast)"
        )
    if setup.uses_lora:
        stored = dtype_name(setup.frozen_linear_bytes)
        nf4 = "NF4 for the adapted linears, " if setup.method == "qlora" else ""
        notes.append(
            f"frozen base: {nf4}{stored} for the other linear weights (lora.base_dtype), fp32 "
            "for embeddings and norms"
        )
    if setup.compile:
        notes.append(
            "torch.compile'd blocks: activations are an estimate (Inductor chooses what to save)"
        )
    if setup.document_masking:
        notes.append(
            "document masking passes a mask to SDPA: flash attention cannot run; the "
            "memory-efficient kernel is assumed (GQA with a mask may fall back to the "
            "math kernel, which saves [b, heads, s, s] attention weights)"
        )
    return notes


def _load_host_bytes(setup: Setup) -> int:
    """Rank 0 holds the full starting weights on the host before broadcasting them
    (lmforge.train.stage): a fresh fp32 model for a preset (large ones without LoRA are
    initialized shard by shard instead), else the checkpoint as stored (bf16 assumed)."""
    num_params = setup.args.num_params()
    if not setup.from_scratch:
        return num_params * 2
    sharded_init = num_params > FULL_INIT_MAX_PARAMS and not setup.uses_lora
    return 0 if sharded_init else num_params * 4


def plan_memory(
    setup: Setup, gpu_memory: int | str | None = None, *, host_memory: int | str | None = None
) -> Plan:
    """Per-GPU memory of one training step of `setup` (see the module docstring).

    gpu_memory: bytes per GPU (or '80GB', 'h100', ...); None: no verdict.
    host_memory: bytes per node; None: HOST_MEMORY_PER_GPU for each GPU of a node.
    """
    check_setup(setup)
    gpu_memory = parse_memory(gpu_memory) if isinstance(gpu_memory, str) else gpu_memory
    if host_memory is None:
        host_memory = HOST_MEMORY_PER_GPU * min(setup.gpus, setup.gpus_per_node)
    host_memory = parse_memory(host_memory)
    specs = param_specs(setup, num_layers=1)  # the blocks are alike: one stands for all
    state = _model_state(setup, specs)
    acts = _step_activations(setup, specs)
    phase_builder = _fsdp_phases if setup.fsdp else _local_phases
    phases, labels = phase_builder(setup, _group_numels(specs, setup), state, acts)
    phases["optimizer step"] = {**state.persistent, "gradients": state.grads}
    if setup.is_grpo:
        phases.update(_rollout_phases(setup, state))
    phases = {k: {c: int(v) for c, v in p.items() if v} for k, p in phases.items()}
    peak_phase = max(phases, key=lambda k: sum(phases[k].values()))
    return Plan(
        setup=setup,
        phases=phases,
        peak_phase=peak_phase,
        overhead=_overhead(setup, sum(phases[peak_phase].values())),
        gpu_memory=gpu_memory,
        host=state.host,
        labels=labels,
        notes=_notes(setup),
        load_host_bytes=_load_host_bytes(setup),
        host_memory=host_memory,
    )


# ----------------------------------------------------------------------------- units, output


def parse_memory(text: str | int) -> int:
    """'80GB' / '80GiB' / '80' (GiB: GPU memory is quoted in binary units), '85e9' (bytes),
    '512MiB', or a GPU name (h100, h200, a100-40gb, a100-80gb, l40s, b200)."""
    if isinstance(text, int):
        return text
    value = str(text).strip().lower().replace(" ", "")
    if value in GPU_MEMORY:
        return GPU_MEMORY[value]
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)(tib|tb|gib|gb|mib|mb|g|m|t)?", value)
    if not match:
        raise ConfigError(
            f"GPU memory {text!r}: expected a size like 80GB, 80GiB, 141GB, 85e9 or a GPU name "
            f"({', '.join(GPU_MEMORY)})"
        )
    number, unit = float(match.group(1)), match.group(2)
    if unit is None:
        scale = GiB if number < 1e6 else 1
    else:
        scale = {
            "t": TiB,
            "tb": TiB,
            "tib": TiB,
            "g": GiB,
            "gb": GiB,
            "gib": GiB,
            "m": 2**20,
            "mb": 2**20,
            "mib": 2**20,
        }[unit]
    return int(number * scale)


def dtype_name(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16"}.get(nbytes, f"{nbytes}-byte")


# ----------------------------------------------------------------------------- from a job


# A config's dtype names (lora.base_dtype, parallel.reduce_dtype) as `Setup` writes them.
_SHORT_DTYPES = {"auto": "auto", "float32": "fp32", "bfloat16": "bf16"}


def setup_from_job(
    job, *, gpus: int, gpus_per_node: int = 8, args: ModelArgs | None = None
) -> Setup:
    """The Setup a training job config (PretrainJob, SFTJob, DPOJob, GRPOJob) runs with on
    `gpus`.

    args: the shape of `job.model.source` when it cannot be read yet (an upstream stage's
    output, a download to come); the job's model overrides still apply.
    """
    from lmforge import api
    from lmforge.models import PRESETS
    from lmforge.train.config import DPOJob, GRPOJob, PretrainJob

    source = job.model.source
    from_scratch = source in PRESETS
    args = args or api.read_args(source)
    if job.model.overrides:
        args = args.replace(**job.model.overrides)
    lora = getattr(job, "lora", None)
    lora_on = lora is not None and lora.enabled
    if isinstance(job, DPOJob):
        method = "dpo-lora" if lora_on else "dpo-full"
    elif isinstance(job, PretrainJob):
        method = "pretrain"
    else:
        method = ("qlora" if lora.quantize_base == "nf4" else "lora") if lora_on else "full"
    data = getattr(job, "data", None)
    seq_len = getattr(data, "seq_len", None) or getattr(data, "max_seq_len", 2048)
    masking = bool(getattr(data, "document_masking", False) or getattr(data, "packing", False))
    masking |= isinstance(job, GRPOJob)  # its sequences packed into rows of seq_len
    base = Setup(
        args=args,
        model_name=str(source),
        method=method,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        dp_replicate=job.parallel.dp_replicate,
        dp_shard=job.parallel.dp_shard,
        tp=job.parallel.tp,
        ep=job.parallel.ep,
        activation_checkpointing=job.parallel.activation_checkpointing,
        cpu_offload=job.parallel.cpu_offload,
        reshard_after_forward=job.parallel.reshard_after_forward,
        reduce_dtype=_SHORT_DTYPES[job.parallel.reduce_dtype],
        compile=job.parallel.compile,
        micro_batch_size=job.train.micro_batch_size,
        seq_len=seq_len,
        compute_dtype="fp32" if job.train.mixed_precision == "fp32" else "bf16",
        bf16_params=job.optim.bf16_params,
        document_masking=masking,
        from_scratch=from_scratch,
    )
    if lora_on:
        base_dtype = _SHORT_DTYPES[lora.base_dtype]
        base = base.replace(
            lora_rank=lora.rank, lora_targets=tuple(lora.targets), lora_base_dtype=base_dtype
        )
    if isinstance(job, DPOJob):
        base = base.replace(dpo_reference=job.dpo.reference)
    if isinstance(job, GRPOJob):
        base = base.replace(
            grpo_generations=job.grpo.num_generations,
            grpo_prompts=job.grpo.prompts_per_step,
            grpo_rollout_batch=job.grpo.rollout_batch,
            grpo_reference=job.grpo.reference if job.grpo.beta else "none",
            grpo_new_tokens=job.grpo.max_new_tokens,
            grpo_fuse_rollouts=job.grpo.fuse_rollouts,
            grpo_share_prompts=job.grpo.share_prompts,
        )
    if job.train.global_batch_size:
        per_pass = job.train.micro_batch_size * base.dp_size
        base = base.replace(grad_accumulation=max(1, job.train.global_batch_size // per_pass))
    return base
