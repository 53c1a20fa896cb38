"""Memory plans of a pipeline's training stages, for `lmforge run` (dry or not).

Each pretrain / sft / dpo stage that is about to run is planned as it will be launched: its job
config on `nodes × nproc_per_node` GPUs of `[plan] gpu_memory`. A stage whose input model is not
on disk yet (the output of an upstream stage, or a download still to come) is planned with the
shape it will have: the upstream stage's model, back to the pipeline's `[model]`, or
`[plan] model` when even that is not there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.errors import UserError
from lmforge.plan.memory import GiB, Plan, parse_memory
from lmforge.plan.search import plan_job

if TYPE_CHECKING:
    from lmforge.models import ModelArgs
    from lmforge.pipeline import Pipeline, Stage

PLAN_FILE = "memory_plan.txt"  # the table, in the stage's directory


@dataclasses.dataclass
class StagePlan:
    stage: Stage
    plan: Plan | None  # None: not planned (see `skipped`)
    skipped: str = ""  # why it was not planned

    def summary(self) -> str:
        head = f"  {self.stage.name:<14} {self.stage.kind:<9}"
        if self.plan is None:
            return f"{head} not planned: {self.skipped}"
        p, s = self.plan, self.plan.setup
        verdict = "fits" if p.fits else "DOES NOT FIT"
        line = (
            f"{head} {s.gpus} GPU{'s' if s.gpus > 1 else ''}: {p.total / GiB:.1f} GiB of "
            f"{p.gpu_memory / GiB:.1f} GiB per GPU, {verdict} ({p.total / p.gpu_memory:.0%})"
        )
        if s.cpu_offload or p.host_fits is False:
            line += f"; host {p.host_per_node / GiB:.0f} GiB per node"
        return line


def plan_stages(pipeline: Pipeline, stages: list[Stage], launcher: str) -> list[StagePlan]:
    """A StagePlan for each training stage in `stages`, as `launcher` would run it."""
    from lmforge.manifest import TRAINING_KINDS

    section = pipeline.plan_section
    plans = []
    for stage in stages:
        if stage.kind not in TRAINING_KINDS:
            continue
        gpu_memory = _gpu_memory(section.gpu_memory, stage, launcher)
        if isinstance(gpu_memory, str):
            plans.append(StagePlan(stage, None, gpu_memory))
            continue
        resources = stage.resources
        try:
            args = source_args(pipeline, stage, section.model)
        except UserError as err:
            plans.append(StagePlan(stage, None, str(err)))
            continue
        plan = plan_job(
            stage.config,
            gpus=resources.nodes * resources.nproc_per_node,
            gpus_per_node=resources.nproc_per_node,
            gpu_memory=gpu_memory,
            host_memory=section.host_memory,
            args=args,
        )
        plans.append(StagePlan(stage, plan))
    return plans


def _gpu_memory(configured: str | None, stage: Stage, launcher: str) -> int | str:
    """Bytes per GPU, or why the stage is not planned."""
    import torch

    device = stage.config.train.device
    if device == "auto":  # as the job will resolve it where it runs
        on_gpu = torch.cuda.is_available() if launcher == "local" else stage.resources.gpus_per_node
        device = "cuda" if on_gpu else "cpu"
    if device == "cpu":
        return "runs on the CPU"
    if configured is not None:
        return parse_memory(configured)
    if launcher == "local" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return "set [plan] gpu_memory (e.g. 80GB, h200) to check that it fits"


def source_args(pipeline: Pipeline, stage: Stage, fallback: str | None = None) -> ModelArgs:
    """The shape of the model `stage` starts from, read from disk when it is there, else from
    the stage that will make it, else from `fallback` (a preset or a config directory)."""
    from lmforge import api
    from lmforge.models import PRESETS

    model = getattr(stage.config, "model", None)
    source = getattr(model, "source", None)
    if source is not None and source in PRESETS:
        return api.read_args(source)
    if source is not None and pipeline.path(Path(source)).exists():
        return api.read_args(pipeline.path(Path(source)))
    if stage.from_stage is not None:
        upstream = pipeline.stage(stage.from_stage)
        args = source_args(pipeline, upstream, fallback)
        overrides = getattr(getattr(upstream.config, "model", None), "overrides", None)
        return args.replace(**overrides) if overrides else args
    if fallback is not None:
        return api.read_args(fallback if fallback in PRESETS else pipeline.path(Path(fallback)))
    raise UserError(
        f"the model {source} is not on disk yet; set [plan] model = PRESET (e.g. llama3.1-70b) "
        "or a config directory to plan with its shape"
    )


def format_stage_plans(plans: list[StagePlan]) -> list[str]:
    """Console lines: one summary per stage, then a warning for each that does not fit."""
    from lmforge.plan.report import format_suggestions

    lines = ["memory plan (lmforge plan) of the training stages, per GPU as launched:"]
    lines += [p.summary() for p in plans]
    for item in plans:
        if item.plan is not None and not item.plan.fits:
            lines.append(
                f"WARNING: stage {item.stage.name!r} will not fit: "
                f"{item.plan.total / GiB:.1f} GiB needed per GPU of "
                f"{item.plan.gpu_memory / GiB:.1f} GiB (the table: "
                f"{item.stage.stage_dir / PLAN_FILE}); as `lmforge plan` flags, "
                + format_suggestions(item.plan.suggestions)
            )
    return lines
