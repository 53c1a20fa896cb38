"""`lmforge run`: plan a pipeline, hand the stages that must run to a launcher (local, Slurm,
Kubernetes) as `StageJob`s, and keep each stage's manifest in step with its job's events."""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lmforge.launch import make_launcher
from lmforge.launch.base import (
    JobHandle,
    JobState,
    Launcher,
    StageJob,
    load_secrets,
    redact,
)
from lmforge.locks import one_writer
from lmforge.manifest import TRAINING_KINDS, read_manifest, write_manifest
from lmforge.pipeline.manifest import (
    STATUS,
    finalize_stage,
    mark_skipped,
    mark_unavailable,
    now,
    pending_manifest,
    record_inputs,
    write_pipeline_record,
)
from lmforge.pipeline.planning import PlanItem, make_plan, plan_memory
from lmforge.pipeline.schema import STAGE_CONFIG
from lmforge.pipeline.spec import Pipeline, Stage, load_pipeline
from lmforge.procs import Terminated


@dataclasses.dataclass
class RunResult:
    pipeline: Pipeline
    plan: list[PlanItem]
    handles: dict[str, JobHandle]
    ok: bool
    report: Path | None = None


def stage_job(
    pipeline: Pipeline, stage: Stage, depends_on: list[str], secrets: Mapping[str, str]
) -> StageJob:
    return StageJob(
        name=stage.name,
        kind=stage.kind,
        argv=list(stage.argv),
        run_dir=pipeline.path(stage.stage_dir),
        resources=stage.resources,
        depends_on=depends_on,
        distributed=stage.distributed,
        workdir=pipeline.workdir,
        secrets=sorted(secrets),
    )


def run_pipeline(
    pipeline: Pipeline | str | Path,
    *,
    launcher: Launcher | str = "local",
    from_stage: str | None = None,
    only: str | None = None,
    dry_run: bool = False,
    secrets_file: str | Path | None = None,
    wait: bool = True,
    echo: Callable[[str], None] | None = None,
    overrides: Sequence[str] = (),
) -> RunResult:
    """Plan and run a pipeline (see the module docstring).

    Args:
        launcher: a Launcher or its name (local, slurm, k8s).
        from_stage: run this stage and every one after it, up to date or not.
        only: run just this stage (its inputs must exist).
        dry_run: print the plan and each stage's command / rendered scripts; run nothing
            (the rendered files are written into the stage directories for inspection).
        secrets_file: NAME=VALUE lines (else pipeline.secrets_file); the environment wins.
        wait: wait for a launcher that returns at once (slurm, k8s) to finish.
        echo: where console lines go (default: print).
        overrides: `key.sub=value` items for the pipeline file (see `load_pipeline`).
    """
    echo = echo or (lambda line: print(line, flush=True))
    if not isinstance(pipeline, Pipeline):
        pipeline = load_pipeline(pipeline, overrides=overrides)
    if isinstance(launcher, str):
        launcher = make_launcher(launcher)
    with contextlib.ExitStack() as held:
        if not dry_run:  # one `lmforge run` at a time writes the run directory
            held.enter_context(one_writer(pipeline.path(pipeline.run_dir)))
        return _plan_and_run(
            pipeline, launcher, from_stage, only, dry_run, secrets_file, wait, echo
        )


def _plan_and_run(
    pipeline: Pipeline,
    launcher: Launcher,
    from_stage: str | None,
    only: str | None,
    dry_run: bool,
    secrets_file: str | Path | None,
    wait: bool,
    echo: Callable[[str], None],
) -> RunResult:
    secrets_file = secrets_file or pipeline.section.secrets_file
    secrets = load_secrets(secrets_file)
    plan = make_plan(pipeline, from_stage=from_stage, only=only)
    to_run = [item for item in plan if item.action == "run"]
    run_names = {item.stage.name for item in to_run}
    jobs = [
        stage_job(
            pipeline, item.stage, [d for d in item.stage.depends_on if d in run_names], secrets
        )
        for item in to_run
    ]

    echo(
        f"pipeline {pipeline.name}: {pipeline.file} -> {pipeline.run_dir} "
        f"({launcher.name} launcher)"
    )
    for item in plan:
        label = {"run": "run", "skip": "up to date", "keep": "left as is",
                 "unavailable": "skipped"}[item.action]  # fmt: skip
        detail = f" ({item.reason})" if item.action in ("run", "unavailable") else ""
        echo(f"  {item.stage.name:<14} {item.stage.kind:<9} {label}{detail}")
    plan_files = plan_memory(pipeline, [item.stage for item in to_run], launcher.name, echo)
    if dry_run:
        for item, job in zip(to_run, jobs):
            echo(f"\n# stage {job.name} ({job.kind})")
            echo(f"$ lmforge {shlex.join(job.argv)}")
            files = {
                STAGE_CONFIG: item.stage.config_text,
                **launcher.render(job),
                **plan_files.get(job.name, {}),
            }
            job.run_dir.mkdir(parents=True, exist_ok=True)
            for file_name, text in files.items():
                text = redact(text, secrets)
                (job.run_dir / file_name).write_text(text)
                echo(f"--- {job.run_dir / file_name}\n{text.rstrip()}")
        return RunResult(pipeline, plan, {}, ok=True)

    write_pipeline_record(pipeline)
    for item in plan:
        if item.action == "skip":
            echo(f"[pipeline] {item.stage.name}: up to date, skipped")
            mark_skipped(pipeline, item.stage)
        elif item.action == "unavailable":
            echo(f"[pipeline] {item.stage.name}: skipped: {item.reason}")
            mark_unavailable(pipeline, item.stage, item.reason)
    if not jobs:
        echo("[pipeline] everything is up to date")
        report = _maybe_report(pipeline, echo)
        return RunResult(pipeline, plan, {}, ok=True, report=report)

    tracker = Tracker(pipeline, {i.stage.name: i for i in to_run}, launcher, secrets, echo)
    for item, job in zip(to_run, jobs):
        tracker.prepare(item, job, plan_files.get(job.name, {}))
    handles: dict[str, JobHandle] = {}
    try:
        handles = launcher.submit(jobs, secrets=secrets, on_event=tracker.event)
        if wait:
            handles = launcher.wait(handles, on_event=tracker.event)
    except (KeyboardInterrupt, Terminated) as stop:
        tracker.interrupted(
            "interrupted (Ctrl-C)"
            if isinstance(stop, KeyboardInterrupt)
            else "terminated (SIGTERM)"
        )
        raise
    for handle in handles.values():
        if handle.state.finished:
            tracker.event(handle)
    ok = all(h.state == JobState.SUCCEEDED for h in handles.values())
    finished = all(h.state.finished for h in handles.values())
    report = None
    if ok:
        skipped = f"; {len(pipeline.unavailable)} skipped" if pipeline.unavailable else ""
        echo(f"[pipeline] {pipeline.name}: all {len(jobs)} stage(s) succeeded{skipped}")
        report = _maybe_report(pipeline, echo)
    elif finished:
        failed = [h for h in handles.values() if h.state in (JobState.FAILED, JobState.CANCELLED)]
        for handle in failed:
            echo(f"[pipeline] stage {handle.name} {handle.state}: {handle.reason}")
        echo(f"[pipeline] details: lmforge status {pipeline.run_dir}")
    else:
        echo(f"[pipeline] submitted; follow with: lmforge status {pipeline.run_dir}")
    return RunResult(pipeline, plan, handles, ok=ok, report=report)


def _maybe_report(pipeline: Pipeline, echo: Callable[[str], None]) -> Path | None:
    if not pipeline.section.report:
        return None
    from lmforge.report import write_report

    paths = write_report(pipeline.path(pipeline.run_dir))
    echo(f"[pipeline] report: {paths['html']} (summary: {paths['markdown']})")
    return paths["html"]


class Tracker:
    """Keeps each stage's manifest in step with its launcher's job events."""

    def __init__(
        self,
        pipeline: Pipeline,
        items: dict[str, PlanItem],
        launcher: Launcher,
        secrets: Mapping[str, str],
        echo: Callable[[str], None],
    ) -> None:
        self.pipeline, self.items, self.launcher = pipeline, items, launcher
        self.secrets, self.echo = secrets, echo
        self.seen: dict[str, JobState] = {}

    def prepare(self, item: PlanItem, job: StageJob, extra_files: Mapping[str, str]) -> None:
        """Clear the stage directory (unless a failed training run can resume), write its
        config, rendered scripts, `extra_files` and a `pending` manifest."""
        stage = item.stage
        stage_dir = job.run_dir
        old = read_manifest(stage_dir) or {}
        resumable = (
            stage.kind in TRAINING_KINDS  # a training run resumes from its last checkpoint
            and old.get("status") in ("failed", "cancelled", "running", "pending", "unknown")
            and old.get("config_hash") == stage.config_hash
            and item.input_hash is not None
            and old.get("input_hash") == item.input_hash
        )
        if stage_dir.exists() and not resumable:
            shutil.rmtree(stage_dir)
        stage_dir.mkdir(parents=True, exist_ok=True)
        (stage_dir / STAGE_CONFIG).write_text(stage.config_text)
        for file_name, text in {**self.launcher.render(job), **extra_files}.items():
            (stage_dir / file_name).write_text(redact(text, self.secrets))
        manifest = pending_manifest(
            self.pipeline,
            stage,
            reason=item.reason,
            resumed=resumable,
            launcher=self.launcher.name,
            secret_names=sorted(self.secrets),
        )
        write_manifest(stage_dir, manifest)

    def event(self, handle: JobHandle) -> None:
        if self.seen.get(handle.name) == handle.state:
            return
        self.seen[handle.name] = handle.state
        item = self.items.get(handle.name)
        if item is None:
            return
        stage_dir = self.pipeline.path(item.stage.stage_dir)
        manifest = read_manifest(stage_dir) or {}
        manifest["launcher"] = handle.to_dict()
        manifest["status"] = STATUS[handle.state]
        name = handle.name
        if handle.state == JobState.RUNNING:
            manifest["started_at"] = now()
            manifest["started_unix"] = time.time()
            record_inputs(self.pipeline, item.stage, manifest)
            job_id = f" (job {handle.job_id})" if handle.job_id else ""
            self.echo(f"[pipeline] {name}: running{job_id}: lmforge {shlex.join(item.stage.argv)}")
        elif handle.state.finished:
            manifest["reason"] = redact(handle.reason, self.secrets)
            if handle.state != JobState.NOT_STARTED:
                manifest["ended_at"] = now()
                if manifest.get("started_unix"):
                    manifest["duration_s"] = round(time.time() - manifest["started_unix"], 2)
            if handle.state == JobState.SUCCEEDED:
                if not manifest.get("input_hash"):
                    record_inputs(self.pipeline, item.stage, manifest)
                finalize_stage(self.pipeline, item.stage, manifest, handle)
                took = manifest.get("duration_s")
                self.echo(
                    f"[pipeline] {name}: succeeded"
                    + (f" in {took:.1f}s" if took is not None else "")
                    + _metrics_line(item.stage.kind, manifest["metrics"])
                )
            else:
                self.echo(f"[pipeline] {name}: {manifest['status']}: {manifest['reason']}")
        write_manifest(stage_dir, manifest)

    def interrupted(self, reason: str) -> None:
        for name, item in self.items.items():
            if self.seen.get(name, JobState.PENDING).finished:
                continue
            stage_dir = self.pipeline.path(item.stage.stage_dir)
            manifest = read_manifest(stage_dir) or {}
            if manifest.get("status") in ("pending", "running"):
                manifest["status"] = (
                    "cancelled" if manifest["status"] == "running" else "not_started"
                )
                manifest["reason"] = reason
                write_manifest(stage_dir, manifest)


def _metrics_line(kind: str, metrics: dict) -> str:
    if kind in TRAINING_KINDS and "loss" in metrics:
        first = metrics.get("first_loss")
        start = f"{first:.3f} -> " if isinstance(first, float) else ""
        return f"; loss {start}{metrics['loss']:.3f}"
    return ""
