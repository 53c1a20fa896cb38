"""What a run will do: stage by stage, run (and why) or skip as up to date, like `make`; and
the GPU memory plans of the training and inference stages about to run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from lmforge.errors import ConfigError, UserError
from lmforge.manifest import read_manifest
from lmforge.pipeline.references import combined_hash, fingerprint
from lmforge.pipeline.spec import Pipeline, Stage


@dataclasses.dataclass
class PlanItem:
    stage: Stage
    action: Literal["run", "skip", "keep", "unavailable"]
    """run: will run; skip: up to date; keep: not selected (--only/--from), left as it is;
    unavailable: cannot run on this installation (`reason` says what enables it)."""
    reason: str
    input_hash: str | None = None


def make_plan(
    pipeline: Pipeline, *, from_stage: str | None = None, only: str | None = None
) -> list[PlanItem]:
    """Decide, stage by stage, what runs (and why) and what is up to date."""
    if from_stage and only:
        raise ConfigError("give --from or --only, not both")
    start = pipeline.stage(from_stage).index if from_stage else None
    if only:
        pipeline.stage(only)
    plan: list[PlanItem] = []
    running: set[str] = set()
    for stage in pipeline.stages:
        if stage.name in pipeline.unavailable:
            plan.append(PlanItem(stage, "unavailable", pipeline.unavailable[stage.name]))
            continue
        manifest = read_manifest(pipeline.path(stage.stage_dir)) or {}
        if only is not None or start is not None:
            selected = stage.name == only if only else stage.index >= start
            if not selected:
                plan.append(PlanItem(stage, "keep", "not selected"))
                continue
            plan.append(PlanItem(stage, "run", "--only" if only else f"--from {from_stage}"))
            running.add(stage.name)
            continue
        upstream = [d for d in stage.depends_on if d in running]
        if upstream:
            plan.append(PlanItem(stage, "run", f"upstream stage {upstream[-1]!r} runs"))
            running.add(stage.name)
            continue
        input_hash = combined_hash(pipeline.input_fingerprints(stage))
        reason = _out_of_date(pipeline, stage, manifest, input_hash)
        if reason is None:
            plan.append(PlanItem(stage, "skip", "up to date", input_hash))
        else:
            plan.append(PlanItem(stage, "run", reason, input_hash))
            running.add(stage.name)
    _check_inputs_exist(pipeline, plan)
    return plan


def _out_of_date(pipeline: Pipeline, stage: Stage, manifest: dict, input_hash: str) -> str | None:
    if not manifest:
        return "no previous run"
    if manifest.get("status") not in ("succeeded", "skipped"):
        return f"last run {manifest.get('status', 'unknown')}"
    if manifest.get("config_hash") != stage.config_hash:
        return "config changed"
    if manifest.get("input_hash") != input_hash:
        return "input changed"
    recorded = (manifest.get("output") or {}).get("hash")
    if recorded is None or fingerprint(pipeline.path(stage.output)) != recorded:
        return "output missing or changed"
    return None


def _check_inputs_exist(pipeline: Pipeline, plan: list[PlanItem]) -> None:
    actions = {item.stage.name: item.action for item in plan}
    for item in plan:
        if item.action != "run":
            continue
        for dep in item.stage.depends_on:
            if actions[dep] != "keep":
                continue
            upstream = pipeline.stage(dep)
            manifest = read_manifest(pipeline.path(upstream.stage_dir)) or {}
            if (
                manifest.get("status") not in ("succeeded", "skipped")
                or not pipeline.path(upstream.output).exists()
            ):
                raise UserError(
                    f"stage {item.stage.name!r} needs the output of stage {dep!r}, which has no "
                    f"successful run; run it first (lmforge run {pipeline.file} --from {dep})"
                )


def plan_memory(
    pipeline: Pipeline, stages: list[Stage], launcher: str, echo: Callable[[str], None]
) -> dict[str, dict[str, str]]:
    """Plan the GPU memory of the training and inference stages about to run (warning about
    those that will not fit) and return each planned stage's table as a file for its
    directory."""
    from lmforge.pipeline.stage_plans import PLAN_FILE, format_stage_plans, plan_stages

    plans = [p for p in plan_stages(pipeline, stages, launcher) if p.skipped != "runs on the CPU"]
    if not plans:
        return {}
    echo("")
    for line in format_stage_plans(plans):
        echo(line)
    return {p.stage.name: {PLAN_FILE: p.table() + "\n"} for p in plans if p.plan is not None}
