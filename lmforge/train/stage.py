"""Build and run one training stage from its job config; shared by pretrain, sft, dpo and grpo.

Run directory layout:
    <run_dir>/job.toml             the resolved job config
    <run_dir>/model/               config.json + tokenizer of the model being trained
    <run_dir>/checkpoints/step-N/  DCP checkpoints (resume state)
    <run_dir>/metrics.jsonl, tensorboard/, profile/
    <run_dir>/artifact/            the stage's output artifact (exports/step-N/ when periodic)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from lmforge import api, artifact, models
from lmforge.config import ModelSection, dump_config
from lmforge.errors import ConfigError, UserError
from lmforge.locks import one_writer
from lmforge.models import ModelArgs, Transformer
from lmforge.modules.lora import (
    WRAPPER_PREFIX,
    LoRASection,
    apply_lora,
    frozen_dtype,
    load_nf4_shard,
    lora_modules,
    lora_state_dict,
    merge_lora,
    nf4_placeholders,
    nf4_summary,
    quantize_base_nf4,
    quantize_like,
    reset_lora_parameters,
    save_peft_adapter,
)
from lmforge.parallel import distributed
from lmforge.sizes import module_bytes
from lmforge.train.checkpoint import Checkpointer, ModelOptimizerState, RNGState
from lmforge.train.config import TrainJob
from lmforge.train.loop import LoopSections, LossStep, Trainer
from lmforge.train.losses import count_label_tokens
from lmforge.train.optim import (
    build_optimizer,
    build_scheduler,
    masters_in_params,
    to_bf16_parameters,
)
from lmforge.train.parallelize import parallelize
from lmforge.train.preempt import PreemptedError

log = logging.getLogger(__name__)

# Above this many parameters a fresh model is initialized shard by shard on its devices instead
# of once on rank 0's CPU and broadcast (faster, but the values then depend on the layout).
FULL_INIT_MAX_PARAMS = 20e9
ARTIFACT_DIR = "artifact"
ADAPTER_DIR = "adapter"  # inside an artifact: the PEFT adapter a LoRA stage trained
MODEL_DIR = "model"


@dataclass
class ModelSpec:
    args: ModelArgs
    tokenizer: object | None
    source: str  # preset name or path
    from_scratch: bool


def resolve_model(section: ModelSection) -> ModelSpec:
    """The model's args and tokenizer from the model section (no weights are read)."""
    from lmforge.data.tokenizer import load_tokenizer

    from_scratch = api.detect_format(section.source) == "preset"
    args = api.read_args(section.source)
    tokenizer = None
    if section.tokenizer:
        tokenizer = load_tokenizer(section.tokenizer)
    elif not from_scratch:
        # A hub id is downloaded whole here (the weights are read next anyway).
        tokenizer = api.load_tokenizer_for(Path(api.local_source(section.source)), args)
    if section.chat_template:
        if tokenizer is None:
            raise ConfigError("model.chat_template needs a tokenizer (model.tokenizer)")
        tokenizer.use_chat_template(_template_text(section.chat_template))
    if section.overrides:
        shaping = sorted(set(section.overrides) - set(args.training_fields))
        if shaping and not from_scratch:
            allowed = ", ".join(args.training_fields) or "none for this family"
            raise ConfigError(
                f"model.overrides.{shaping[0]} only applies to presets (a loaded model's shape "
                f"is fixed by its weights; a loaded model takes: {allowed}); model.source = "
                f"{section.source!r}"
            )
        args = args.replace(**section.overrides)
    if from_scratch and tokenizer is not None and "vocab_size" not in section.overrides:
        args = args.replace(vocab_size=tokenizer.vocab_size)
        args = args.replace(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    if tokenizer is not None and tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{args.vocab_size} (model.source = {section.source!r})"
        )
    return ModelSpec(
        args=args, tokenizer=tokenizer, source=section.source, from_scratch=from_scratch
    )


def _template_text(value: str) -> str:
    """model.chat_template: the text of a .jinja file, or the template itself."""
    if value.endswith((".jinja", ".j2")) or ("{" not in value and "\n" not in value):
        path = Path(value).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"model.chat_template = {value!r}: {err.strerror}") from None
    return value


def seed_everything(seed: int, rank: int, deterministic: bool) -> None:
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        # MKL's products otherwise may round by their operands' memory alignment; read at its
        # first call, so this holds where no matrix product ran before (the CLI's process)
        os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def _base_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """The starting weights, full and on the CPU (fresh init for a preset)."""
    if spec.from_scratch:
        return api.build_model(spec.args, seed=seed).state_dict()
    return api.with_new_state(api.read_state_dict(spec.source, spec.args), spec.args)


def _cpu_lora_model(args: ModelArgs, lora: LoRASection, seed: int) -> Transformer:
    """A CPU model with adapters initialized from `seed` (base weights left unset)."""
    with torch.device("meta"):
        model = models.new_model(args)
    apply_lora(model, targets=lora.targets, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_buffers("cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reset_lora_parameters(model)
    return model


def _initial_state_on_rank0(
    spec: ModelSpec, layout, job: TrainJob, lora
) -> dict[str, torch.Tensor]:
    """Rank 0's full starting state (others get it by broadcast): base weights, plus adapters
    initialized on the CPU from the seed, so every layout starts from identical values."""
    if not layout.is_main:
        return {}
    state = _base_state(spec, job.train.seed)
    if lora is not None:
        state.update(lora_state_dict(_cpu_lora_model(spec.args, lora, job.train.seed)))
    return state


def _check_lora_layout(lora: LoRASection, layout: distributed.Layout, job: TrainJob) -> None:
    if layout.tp_size > 1:
        raise ConfigError("lora.enabled with parallel.tp > 1 is not supported; use FSDP (dp_shard)")
    if layout.ep_size > 1 and lora.quantize_base == "nf4":
        raise ConfigError(
            'lora.quantize_base = "nf4" (QLoRA) with parallel.ep > 1 is not supported yet; set '
            "parallel.ep = 1, or train LoRA with bf16 bases"
        )
    if lora.quantize_base == "nf4" and job.parallel.cpu_offload:
        raise ConfigError(
            'lora.quantize_base = "nf4" (QLoRA) cannot be combined with parallel.cpu_offload'
        )


def build_and_load_model(
    spec: ModelSpec,
    layout: distributed.Layout,
    job: TrainJob,
    *,
    bf16: bool,
    reshard: ReshardPolicy,
    lora: LoRASection | None = None,
) -> Transformer:
    """Meta-device build → LoRA swap → parallelize → materialize → fill weights (→ NF4 base).
    `reshard` decides parallel.reshard_after_forward = "auto" (`resolved_parallel`)."""
    with torch.device("meta"):
        model = models.new_model(spec.args)
    sharded_init = spec.from_scratch and spec.args.num_params() > FULL_INIT_MAX_PARAMS
    if lora is not None:
        _check_lora_layout(lora, layout, job)
        if getattr(spec.args, "router_bias_update", 0):
            raise ConfigError(
                "model router_bias_update (DeepSeek-V3's selection bias) trains the routing; "
                "a LoRA adapter cannot carry it: set it to 0 with lora.enabled, or train fully"
            )
        apply_lora(
            model,
            targets=lora.targets,
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            base_dtype=frozen_dtype(lora, bf16),
        )
    sharded_nf4 = lora is not None and lora.quantize_base == "nf4" and layout.dp_size > 1
    if sharded_nf4:  # FSDP2 shards the packed NF4 bases (QLoRA across processes)
        nf4_placeholders(model, num_shards=layout.mesh["dp_shard"].size())
    parallelize(model, layout, resolved_parallel(job, spec, layout, reshard), bf16=bf16)
    model.to_empty(device="cpu" if job.parallel.cpu_offload else layout.device)
    # FSDP2 swaps tensors in place (the tie survives); a plain module gets new ones (re-tie).
    model.tie_weights()
    model.init_buffers(layout.device)
    if sharded_init and lora is None:
        with torch.no_grad():
            torch.manual_seed(job.train.seed)
            model.init_weights()
        return model
    state = _initial_state_on_rank0(spec, layout, job, lora)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=layout.world_size > 1)
    if spec.args.tie_embeddings and state:
        # One parameter under two names: a distributed load expects both keys.
        state["output.weight"] = state["tok_embeddings.weight"]
    if sharded_nf4:
        bases = {name: state.pop(name, None) for name in _lora_base_names(model)}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, state, options=options)
    if sharded_nf4:
        _load_nf4_bases(model, bases, layout)
    if lora is None:
        return model
    before = module_bytes(model)  # this process's share (its FSDP shards under FSDP)
    stored = str(frozen_dtype(lora, bf16) or torch.float32).removeprefix("torch.")
    if lora.quantize_base == "nf4" and not sharded_nf4:
        quantize_base_nf4(model)
    if layout.is_main and lora.quantize_base == "nf4":
        log.warning(
            "QLoRA: adapted base weights in NF4, other frozen linears in %s: model memory "
            "%s%.1f MB per process (%s)",
            stored,
            "" if sharded_nf4 else f"{before / 1e6:.1f} MB -> ",
            module_bytes(model) / 1e6,
            nf4_summary(model),
        )
    elif layout.is_main:
        log.warning("LoRA: frozen linear weights in %s: model memory %.1f MB", stored, before / 1e6)
    return model


class ReshardPolicy(Protocol):
    """Decides parallel.reshard_after_forward = "auto" for a job: whether each block's gathered
    weights are freed after its forward. The command hands in the planner's
    (`lmforge.plan.search.ReshardByPlan`): the planner reads train's job configs, so train does
    not import it."""

    keep_fraction: float  # (for the log) the share of the GPU's memory the decision allows

    def __call__(
        self, job: TrainJob, args: ModelArgs, world_size: int, device_memory: int | None
    ) -> bool:
        """True: reshard after forward. `device_memory`: bytes, None on the CPU."""
        ...


def resolved_parallel(
    job: TrainJob, spec: ModelSpec, layout: distributed.Layout, reshard: ReshardPolicy
):
    """job.parallel with reshard_after_forward = "auto" decided by `reshard` for this job on
    this device (the planner's prediction against the GPU's memory)."""
    if job.parallel.reshard_after_forward != "auto":
        return job.parallel
    device_memory = None
    if layout.device.type == "cuda":
        device_memory = torch.cuda.get_device_properties(layout.device).total_memory
    choice = reshard(job, spec.args, layout.world_size, device_memory)
    return job.parallel.model_copy(update={"reshard_after_forward": choice})


def _log_reshard_choice(
    job: TrainJob, spec: ModelSpec, layout: distributed.Layout, reshard: ReshardPolicy
) -> None:
    uses_fsdp = layout.dp_size > 1 or job.parallel.cpu_offload
    if job.parallel.reshard_after_forward != "auto" or not uses_fsdp or not layout.is_main:
        return
    choice = resolved_parallel(job, spec, layout, reshard).reshard_after_forward
    if layout.device.type != "cuda":
        why = "on the CPU"
    else:
        memory = torch.cuda.get_device_properties(layout.device).total_memory
        fits = "does not fit" if choice else "fits"
        why = (
            f"the planner says the job with gathered weights kept {fits} in "
            f"{reshard.keep_fraction:.0%} of {memory / 2**30:.1f} GiB"
        )
    log.warning("parallel.reshard_after_forward = auto -> %s (%s)", str(choice).lower(), why)


def _lora_base_names(model: torch.nn.Module) -> list[str]:
    """State-dict names of the adapted base weights."""
    return [f"{name.replace(WRAPPER_PREFIX, '')}.weight" for name in lora_modules(model)]


def _load_nf4_bases(model: torch.nn.Module, bases: dict, layout: distributed.Layout) -> None:
    """Rank 0 quantizes each full base weight once (exactly as one process does) and
    broadcasts the packed tensors; every rank keeps its FSDP shard of them."""
    shards = layout.mesh["dp_shard"].size()
    index = layout.mesh.get_local_rank("dp_shard")
    for name, module in zip(_lora_base_names(model), lora_modules(model).values()):
        local = module.weight._local_tensor  # the object FSDP2 all-gathers (to_local: a view)
        source = bases[name] if layout.is_main else torch.ones(module.weight.shape)
        full = quantize_like(source.to(device=local.device, dtype=local.dtype))
        for inner in full.__tensor_flatten__()[0]:
            dist.broadcast(getattr(full, inner), src=0)
        load_nf4_shard(local, full, index=index, num_shards=shards)


def export_artifact(
    model: torch.nn.Module,
    spec: ModelSpec,
    layout: distributed.Layout,
    out_dir: Path,
    *,
    dtype: str,
    stage: str,
    parent: str | None,
    config: dict,
    metrics: dict,
    lora: LoRASection | None = None,
    seed: int = 0,
) -> None:
    """Gather the weights (a collective: every rank calls this) and write an artifact.

    With LoRA only the adapters are gathered; rank 0 merges them into the original base
    weights (full precision, even after QLoRA) and also writes the PEFT adapter to
    `<artifact>/adapter/`."""
    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora is not None
    )
    state = get_model_state_dict(model, options=options)
    if layout.is_main:
        adapter_staging = None
        if lora is not None:
            adapter_staging = out_dir.parent / f".{out_dir.name}.adapter-{os.getpid()}"
            state = _merge_adapters(spec, lora, state, adapter_staging, seed)
        api.save_state(
            state,
            spec.args,
            spec.tokenizer,
            out_dir,
            dtype=dtype,
            stage=stage,
            parent=parent,
            config=config,
            metrics=metrics,
            overwrite=True,  # the run's own output, written again by a longer run
        )
        if adapter_staging is not None:
            artifact.make_readable(adapter_staging)
            os.replace(adapter_staging, out_dir / ADAPTER_DIR)
    if layout.world_size > 1:
        dist.barrier()


def _merge_adapters(
    spec: ModelSpec, lora: LoRASection, adapters: dict, adapter_dir: Path, seed: int
) -> dict[str, torch.Tensor]:
    """Write the PEFT adapter to `adapter_dir`; return base + adapters merged (full state)."""
    model = _cpu_lora_model(spec.args, lora, seed)
    state = _base_state(spec, seed)
    state.update({name: tensor for name, tensor in adapters.items() if ".lora_" in name})
    if spec.args.tie_embeddings:
        state.pop("output.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    # An absolute path, so that PEFT finds the base from any working directory.
    local = Path(spec.source).expanduser()
    base_model = str(local.resolve()) if local.exists() else str(spec.source)
    save_peft_adapter(model, spec.args, adapter_dir, base_model=base_model, lora_cfg=lora)
    merge_lora(model)
    return model.state_dict()


def computes_in_bf16(job: TrainJob, layout: distributed.Layout) -> bool:
    """train.mixed_precision: bf16 always, fp32 never, auto on CUDA (the one rule for every
    model a stage builds: the policy and DPO's frozen reference)."""
    precision = job.train.mixed_precision
    return precision == "bf16" or (precision == "auto" and layout.device.type == "cuda")


def keeps_bf16_params(job: TrainJob, layout: distributed.Layout, bf16: bool) -> bool:
    """optim.bf16_params: whether the trainable weights are bf16 with fp32 masters in the
    optimizer (`lmforge.train.adamw`); true where it cannot apply is a ConfigError."""
    wanted = job.optim.bf16_params
    if wanted is False:
        return False
    unmet = [
        reason
        for reason, met in (
            ("bf16 compute (train.mixed_precision)", bf16),
            ("a CUDA device", layout.device.type == "cuda"),
            ("one process (no FSDP, no TP)", layout.world_size == 1),
            ("no parallel.cpu_offload", not job.parallel.cpu_offload),
            ("full training (lora.enabled = false)", lora_section(job) is None),
            ("the fused optimizer (optim.fused)", job.optim.fused is not False),
        )
        if not met
    ]
    if wanted and unmet:
        raise ConfigError(f"optim.bf16_params = true needs {'; '.join(unmet)}")
    return not unmet


def bf16_weights(model: torch.nn.Module) -> bool:
    """Whether the model's trainable weights are bf16 (fp32 masters in the optimizer)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return bool(trainable) and all(p.dtype == torch.bfloat16 for p in trainable)


def check_job(job: TrainJob, spec: ModelSpec, layout: distributed.Layout, seq_len: int) -> None:
    """Refuse, before anything is written, what would only fail later (or lose the run)."""
    if seq_len > spec.args.max_seq_len:
        raise ConfigError(
            f"the data's sequence length {seq_len} exceeds the model's max_seq_len "
            f"{spec.args.max_seq_len}; shorten data.seq_len / data.max_seq_len or raise "
            "model.overrides.max_seq_len"
        )
    if job.parallel.cpu_offload and layout.device.type != "cuda":
        raise ConfigError(
            "parallel.cpu_offload = true moves GPU state to host memory; this run is on the "
            "CPU already: set parallel.cpu_offload = false"
        )
    run_dir = Path(job.run_dir)
    saved = run_dir / MODEL_DIR / artifact.CONFIG_NAME
    if saved.is_file() and Checkpointer(run_dir).committed():  # quiet: restore warns later
        before = models.args_from_hf_config(artifact.read_json(saved), saved)
        changed = {
            name: (getattr(before, name), getattr(spec.args, name))
            for name in ("dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim", "vocab_size")
            if getattr(before, name) != getattr(spec.args, name)
        }
        if changed:
            diff = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
            raise ConfigError(
                f"{run_dir} holds checkpoints of another model shape ({diff}); resume with the "
                "same model, or use another run_dir"
            )


def write_run_files(run_dir: Path, job: TrainJob, spec: ModelSpec) -> None:
    """job.toml and model/ (config.json + tokenizer) so `lmforge export` can rebuild the model."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / ".write-test").touch()
        (run_dir / ".write-test").unlink()
    except OSError as err:
        raise UserError(f"cannot write to run_dir {run_dir}: {err.strerror or err}") from None
    (run_dir / "job.toml").write_text(dump_config(job, "toml"))
    model_dir = run_dir / MODEL_DIR
    model_dir.mkdir(exist_ok=True)
    artifact.write_json(
        model_dir / artifact.CONFIG_NAME, models.args_to_hf_config(spec.args, torch.float32)
    )
    if spec.tokenizer is not None:
        spec.tokenizer.save(model_dir)


def lora_section(job: TrainJob) -> LoRASection | None:
    lora = getattr(job, "lora", None)
    return lora if lora is not None and lora.enabled else None


def resolve_reference(job: TrainJob, requested: str, key: str) -> str:
    """The frozen starting point a loss compares the policy with (`key` names the setting):
    "adapters_disabled", the policy with its LoRA adapters off (no second copy), or
    "frozen_copy"; "auto" takes the first with LoRA, else the second."""
    lora = lora_section(job)
    kind = requested
    if kind == "auto":
        kind = "adapters_disabled" if lora is not None else "frozen_copy"
    if kind == "adapters_disabled" and lora is None:
        raise ConfigError(f'{key} = "adapters_disabled" needs lora.enabled = true')
    return kind


def frozen_reference(job: TrainJob, model, spec: ModelSpec, layout, reshard: ReshardPolicy):
    """A frozen copy of the starting weights, built and sharded like the policy `model` (in
    bf16 where the policy's weights are bf16, so the two score alike at the start)."""
    bf16 = computes_in_bf16(job, layout)
    reference = build_and_load_model(spec, layout, job, bf16=bf16, reshard=reshard).eval()
    reference.requires_grad_(False)
    if bf16_weights(model):  # (fp32 masters in the optimizer) the same bf16 weights
        to_bf16_parameters(reference)
    return reference


def data_loader_factory(job, stage: str, load_data: Callable, loader_cls: type) -> Callable:
    """The `make_batches` of a post-training stage: tokenize `job.data` with the model's
    tokenizer (`load_data(section, tokenizer)`) and give this data-parallel rank its slice."""

    def make(layout: distributed.Layout, spec: ModelSpec):
        if spec.tokenizer is None:
            raise ConfigError(
                f"{stage} needs a tokenizer: model.source {spec.source!r} has none; "
                "set model.tokenizer"
            )
        dataset = load_data(job.data, spec.tokenizer)
        if layout.is_main:
            log.warning("%s data: %s", stage, dataset.summary())
        return _rank_loader(loader_cls, dataset.samples, job, spec, layout)

    return make


def _rank_loader(loader_cls: type, samples, job, spec: ModelSpec, layout: distributed.Layout):
    """A loader over `samples` giving this data-parallel rank its slice of each batch."""
    return loader_cls.from_section(
        samples,
        job.data,
        spec.tokenizer,
        micro_batch_size=job.train.micro_batch_size,
        dp_rank=layout.dp_rank,
        dp_size=layout.dp_size,
        seed=job.train.seed,
        width_multiple=layout.tp_size,
    )


def heldout_factory(job, load_data: Callable, loader_cls: type) -> Callable | None:
    """The `make_heldout` of a post-training stage when `train.eval_every` is set: (layout,
    spec) -> a function giving one pass over `data.heldout`, in whole batches of this rank's
    slice (every rank gets as many). None when evaluation is off."""
    if not job.train.eval_every:
        return None
    if not job.data.heldout:
        raise ConfigError("train.eval_every needs held-out rows: set data.heldout")

    def make(layout: distributed.Layout, spec: ModelSpec):
        samples = load_data(job.data, spec.tokenizer, heldout=True).samples
        per_batch = job.train.micro_batch_size * layout.dp_size
        num_batches = len(samples) // per_batch
        if num_batches == 0:
            raise ConfigError(
                f"data.heldout has {len(samples)} samples, fewer than one batch of "
                f"train.micro_batch_size × data-parallel size = {per_batch}"
            )

        def one_pass() -> Iterable[dict]:
            loader = _rank_loader(loader_cls, samples, job, spec, layout)
            return itertools.islice(iter(loader), num_batches)

        return one_pass

    return make


def run_stage(
    job: TrainJob,
    *,
    stage: str,
    make_batches: Callable[[distributed.Layout, ModelSpec], Iterable[dict]],
    make_loss_step: Callable[[torch.nn.Module, ModelSpec, distributed.Layout], LossStep],
    reshard: ReshardPolicy,
    count_targets: Callable[[dict], torch.Tensor] = count_label_tokens,
    make_heldout: Callable | None = None,
) -> Path:
    """Run a training stage to its last step (resuming when the run dir has checkpoints) and
    return the path of the artifact it wrote.

    Args:
        make_batches: (layout, spec) -> the stage's loader (resumable when it has state_dict).
        make_loss_step: (model, spec, layout) -> loss_step(model, batch) -> LossOutput.
        reshard: decides parallel.reshard_after_forward = "auto" (`ReshardPolicy`).
        count_targets: batch -> the number of targets the loss is averaged over.
        make_heldout: (layout, spec) -> () -> one pass over held-out batches (`heldout_factory`),
            for `train.eval_every`.
    """
    layout = distributed.setup(job.parallel, job.train.device)
    together = (
        False  # whether every rank leaves from the same point (then they wait for each other)
    )
    try:
        with contextlib.ExitStack() as held:
            _hold_run_dir(held, job.run_dir, layout)
            artifact = _run(
                job, layout, stage, make_batches, make_loss_step, reshard, count_targets,
                make_heldout,
            )  # fmt: skip
        together = True
        return artifact
    except PreemptedError:
        together = True  # every rank stopped after the same step (the flag is all-reduced)
        raise
    finally:
        distributed.teardown(wait_for_all=together)


def _hold_run_dir(held: contextlib.ExitStack, run_dir: str, layout: distributed.Layout) -> None:
    """Rank 0 takes the run directory's writer lock (`lmforge.locks`) for `held`'s life; every
    rank learns whether it got it (a refused rank 0 alone would leave the others waiting in a
    collective)."""
    refusal: UserError | None = None
    if layout.is_main:
        try:
            if Path(run_dir).exists() and not Path(run_dir).is_dir():
                raise ConfigError(f"run_dir = {run_dir!r} is a file; name a directory")
            held.enter_context(one_writer(run_dir))
        except UserError as err:
            refusal = err
        except OSError as err:  # read-only, permission, quota: the user's to fix
            refusal = UserError(f"cannot write to run_dir {run_dir}: {err.strerror or err}")
    if layout.world_size > 1:
        told = [refusal]
        dist.broadcast_object_list(told, src=0)
        refusal = told[0]
    if refusal is not None:
        raise refusal


def _run(
    job, layout, stage, make_batches, make_loss_step, reshard, count_targets, make_heldout
) -> Path:
    if job.train.eval_every and make_heldout is None:
        raise ConfigError(f"train.eval_every: {stage} has no held-out data to evaluate on")
    seed_everything(job.train.seed, layout.rank, job.train.deterministic)
    run_dir = Path(job.run_dir)
    spec = resolve_model(job.model)
    lora = lora_section(job)
    bf16 = computes_in_bf16(job, layout)
    seq_len = getattr(job.data, "seq_len", None) or getattr(job.data, "max_seq_len", 2048)
    check_job(job, spec, layout, seq_len)
    bf16_params = keeps_bf16_params(job, layout, bf16)
    if layout.is_main:
        write_run_files(run_dir, job, spec)
    _log_reshard_choice(job, spec, layout, reshard)
    model = build_and_load_model(spec, layout, job, bf16=bf16, reshard=reshard, lora=lora)
    model.train()
    optimizer = build_optimizer(model, job.optim, layout.device, bf16_params=bf16_params)
    scheduler = build_scheduler(optimizer, job.scheduler, job.train.steps)
    loader = make_batches(layout, spec)
    heldout = make_heldout(layout, spec) if make_heldout is not None else None
    checkpoint_state = {
        # With LoRA only the adapters (and their optimizer state) are checkpointed: the frozen
        # base is read again from its source on resume.
        "model": ModelOptimizerState(model, optimizer, trainable_only=lora is not None),
        "scheduler": scheduler,
        "rng": RNGState(),
    }
    if hasattr(loader, "state_dict"):  # resumable loaders restore the exact next batch
        checkpoint_state["dataloader"] = loader
    config = job.model_dump(mode="json")
    parent = None if spec.from_scratch else spec.source

    def export(step: int, final: bool) -> None:
        out = run_dir / (ARTIFACT_DIR if final else f"exports/step-{step:08d}")
        with masters_in_params(optimizer):  # the fp32 values of bf16 weights
            export_artifact(
                model,
                spec,
                layout,
                out,
                dtype=job.checkpoint.export_dtype,
                stage=stage,
                parent=parent,
                config=config,
                metrics={"step": step, **trainer.last_metrics},
                lora=lora,
                seed=job.train.seed,
            )

    trainer = Trainer(
        model=model,
        loss_step=make_loss_step(model, spec, layout),
        batches=iter(loader),
        optimizer=optimizer,
        scheduler=scheduler,
        layout=layout,
        sections=LoopSections(job.train, job.checkpoint, job.metrics, job.profile),
        run_dir=run_dir,
        checkpointer=Checkpointer(
            run_dir, keep_last=job.checkpoint.keep_last, async_save=job.checkpoint.async_save
        ),
        checkpoint_state=checkpoint_state,
        flops_per_token=spec.args.flops_per_token(seq_len),
        bf16=bf16,
        export=export,
        job_config=config,
        count_targets=count_targets,
        heldout=heldout,
        batch_metrics=getattr(loader, "step_metrics", None),  # a source that measures its own
    )
    trainer.run()
    return run_dir / ARTIFACT_DIR
