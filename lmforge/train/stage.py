"""Build and run one training stage from its job config; shared by pretrain, sft and dpo.

Run directory layout:
    <run_dir>/job.toml             the resolved job config
    <run_dir>/model/               config.json + tokenizer of the model being trained
    <run_dir>/checkpoints/step-N/  DCP checkpoints (resume state)
    <run_dir>/metrics.jsonl, tensorboard/, profile/
    <run_dir>/artifact/            the stage's output artifact (exports/step-N/ when periodic)
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from lmforge import api, artifact
from lmforge.config import ModelSection, dump_config
from lmforge.errors import ConfigError
from lmforge.models.llama import ModelArgs, Transformer
from lmforge.models.llama import hf as llama_hf
from lmforge.train import distributed
from lmforge.train.checkpoint import Checkpointer, ModelOptimizerState, RNGState
from lmforge.train.config import TrainJob
from lmforge.train.loop import LoopSections, LossStep, Trainer
from lmforge.train.optim import build_optimizer, build_scheduler
from lmforge.train.parallelize import parallelize

log = logging.getLogger(__name__)

# Above this many parameters a fresh model is initialized shard by shard on its devices instead
# of once on rank 0's CPU and broadcast (faster, but the values then depend on the layout).
FULL_INIT_MAX_PARAMS = 20e9
ARTIFACT_DIR = "artifact"
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
        tokenizer = api.load_tokenizer_for(Path(section.source), args)
    if section.overrides:
        if not from_scratch:
            raise ConfigError(
                "model.overrides only applies to presets (a loaded model's shape is fixed by its "
                f"weights); model.source = {section.source!r}"
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


def seed_everything(seed: int, rank: int, deterministic: bool) -> None:
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def _full_state_on_rank0(spec: ModelSpec, layout, seed: int) -> dict[str, torch.Tensor]:
    if not layout.is_main:
        return {}
    if spec.from_scratch:
        return api.build_model(spec.args, seed=seed).state_dict()
    return api.read_state_dict(spec.source, spec.args)


def build_and_load_model(
    spec: ModelSpec,
    layout: distributed.Layout,
    job: TrainJob,
    *,
    bf16: bool,
    transform: Callable[[Transformer], None] | None = None,
) -> Transformer:
    """Meta-device build → (transform, e.g. LoRA) → parallelize → materialize → fill weights."""
    with torch.device("meta"):
        model = Transformer(spec.args)
    sharded_init = spec.from_scratch and spec.args.num_params() > FULL_INIT_MAX_PARAMS
    if transform is not None:
        transform(model)
    parallelize(model, layout, job.parallel, bf16=bf16)
    model.to_empty(device="cpu" if job.parallel.cpu_offload else layout.device)
    if not isinstance(model.tok_embeddings.weight, DTensor):
        model.tie_weights()
    model.init_buffers(layout.device)
    if sharded_init:
        with torch.no_grad():
            torch.manual_seed(job.train.seed)
            model.init_weights()
        return model
    state = _full_state_on_rank0(spec, layout, job.train.seed)
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=layout.world_size > 1, strict=transform is None
    )
    if spec.args.tie_embeddings:
        state.pop("output.weight", None)
    set_model_state_dict(model, state, options=options)
    return model


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
) -> None:
    """Gather the full weights (a collective: every rank calls this) and write an artifact."""
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if layout.is_main:
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
        )
    if layout.world_size > 1:
        dist.barrier()


def write_run_files(run_dir: Path, job: TrainJob, spec: ModelSpec) -> None:
    """job.toml and model/ (config.json + tokenizer) so `lmforge export` can rebuild the model."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.toml").write_text(dump_config(job, "toml"))
    model_dir = run_dir / MODEL_DIR
    model_dir.mkdir(exist_ok=True)
    artifact.write_json(
        model_dir / artifact.CONFIG_NAME, llama_hf.args_to_hf_config(spec.args, torch.float32)
    )
    if spec.tokenizer is not None:
        spec.tokenizer.save(model_dir)


def run_stage(
    job: TrainJob,
    *,
    stage: str,
    make_batches: Callable[[distributed.Layout, ModelSpec], Iterable[dict]],
    loss_step: LossStep,
    transform: Callable[[Transformer], None] | None = None,
) -> Path:
    """Run a training stage to its last step (resuming when the run dir has checkpoints) and
    return the path of the artifact it wrote."""
    layout = distributed.setup(job.parallel, job.train.device)
    try:
        return _run(job, layout, stage, make_batches, loss_step, transform)
    finally:
        distributed.teardown()


def _run(job, layout, stage, make_batches, loss_step, transform) -> Path:
    seed_everything(job.train.seed, layout.rank, job.train.deterministic)
    run_dir = Path(job.run_dir)
    spec = resolve_model(job.model)
    bf16 = job.train.mixed_precision == "bf16" or (
        job.train.mixed_precision == "auto" and layout.device.type == "cuda"
    )
    if layout.is_main:
        write_run_files(run_dir, job, spec)
    model = build_and_load_model(spec, layout, job, bf16=bf16, transform=transform)
    model.train()
    optimizer = build_optimizer(model, job.optim, layout.device)
    scheduler = build_scheduler(optimizer, job.scheduler, job.train.steps)
    loader = make_batches(layout, spec)
    checkpoint_state = {
        "model": ModelOptimizerState(model, optimizer),
        "scheduler": scheduler,
        "rng": RNGState(),
    }
    if hasattr(loader, "state_dict"):  # resumable loaders restore the exact next batch
        checkpoint_state["dataloader"] = loader
    config = job.model_dump(mode="json")
    parent = None if spec.from_scratch else spec.source

    def export(step: int, final: bool) -> None:
        out = run_dir / (ARTIFACT_DIR if final else f"exports/step-{step:08d}")
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
        )

    trainer = Trainer(
        model=model,
        loss_step=loss_step,
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
        flops_per_token=spec.args.flops_per_token(
            getattr(getattr(job, "data", None), "seq_len", 2048)
        ),
        bf16=bf16,
        export=export,
        job_config=config,
    )
    trainer.run()
    return run_dir / ARTIFACT_DIR
