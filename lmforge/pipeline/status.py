"""`lmforge status`: each stage's state from its manifest; a job still pending or running is
asked about through its launcher (a Slurm or Kubernetes job outlives the `lmforge run` that
submitted it), and a local stage whose runner died is reported as interrupted."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

from lmforge.errors import UserError
from lmforge.launch import make_launcher
from lmforge.launch.base import JobHandle, JobState
from lmforge.manifest import (
    MANIFEST_NAME,
    PIPELINE_RECORD,
    TRAINING_KINDS,
    pipeline_stages,
    read_manifest,
    write_manifest,
)
from lmforge.pipeline.manifest import STATUS, finalize_stage, now, record_inputs
from lmforge.pipeline.schema import PipelineSection
from lmforge.pipeline.spec import load_pipeline
from lmforge.procs import process_alive


@dataclasses.dataclass
class StageStatus:
    name: str
    kind: str
    status: str
    reason: str
    started_at: str | None
    ended_at: str | None
    duration_s: float | None
    metrics: dict
    job: dict | None
    scheduler_state: str | None = None


def pipeline_status(run_dir: str | Path, *, refresh: bool = True) -> list[StageStatus]:
    """Each stage's state from its manifest; with `refresh`, a job still pending or running is
    asked about through its launcher's `status()`, and a finished one's manifest updated."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory (expected runs/<pipeline>)")
    stages = pipeline_stages(run_dir)
    if not stages:
        raise UserError(f"{run_dir}: no {PIPELINE_RECORD} and no stage manifests")
    result = []
    for entry in stages:
        stage_dir = run_dir / entry["name"]
        manifest = read_manifest(stage_dir)
        if manifest is None:
            result.append(
                StageStatus(
                    entry["name"], entry["kind"], "never run", "", None, None, None, {}, None
                )
            )
            continue
        scheduler_state = None
        job = manifest.get("launcher")
        gone = _runner_gone(manifest)
        if gone:  # a stage that had not started did not stop: it never ran
            started = manifest.get("status") == "running"
            manifest.update(status="interrupted" if started else "not_started", reason=gone)
        elif (
            refresh
            and job
            and job.get("job_id")
            and manifest.get("status") in ("pending", "running")
        ):
            scheduler_state = _refresh(run_dir, stage_dir, manifest)
        result.append(
            StageStatus(
                entry["name"],
                manifest.get("kind", entry["kind"]),
                manifest.get("status", "unknown"),
                manifest.get("reason", ""),
                manifest.get("started_at"),
                manifest.get("ended_at"),
                manifest.get("duration_s"),
                manifest.get("metrics", {}),
                manifest.get("launcher"),
                scheduler_state,
            )
        )
    return result


def latest_run_dir(runs: str | Path | None = None) -> Path:
    """The run directory (`<runs>/<pipeline>`) that `lmforge run` wrote to last: the one whose
    pipeline.json or stage manifest was modified most recently. `runs` defaults to the pipeline
    files' default run_dir ("runs", relative to the working directory)."""
    runs = Path(runs if runs is not None else PipelineSection.model_fields["run_dir"].default)
    newest: tuple[float, str] | None = None
    for run_dir in sorted(runs.iterdir()) if runs.is_dir() else []:
        for record in [run_dir / PIPELINE_RECORD, *run_dir.glob(f"*/{MANIFEST_NAME}")]:
            try:
                modified = record.stat().st_mtime
            except OSError:  # absent (or removed since the listing)
                continue
            if newest is None or modified > newest[0]:
                newest = (modified, str(run_dir))
    if newest is None:
        raise UserError(
            f"no run directory under {runs}/ (none holds a {PIPELINE_RECORD} or a stage's "
            f"{MANIFEST_NAME}); pass RUN_DIR, e.g. `lmforge status {runs}/<pipeline>`"
        )
    return Path(newest[1])


def _runner_gone(manifest: dict) -> str | None:
    """Why a pending or running stage of the local launcher can no longer finish (the
    `lmforge run` that started it is dead), or None. Other launchers' jobs outlive the runner
    (`--detach`): their scheduler says how they are."""
    runner = manifest.get("runner") or {}
    local = (manifest.get("launcher") or {}).get("name", "local") == "local"
    if manifest.get("status") not in ("pending", "running") or not local or not runner:
        return None
    if runner.get("host") != socket.gethostname():
        return None  # another machine's process: nothing to ask here
    pid = runner.get("pid")
    if not isinstance(pid, int) or process_alive(pid):
        return None
    if manifest.get("status") == "pending":
        return (
            f"the `lmforge run` that was to start it (pid {pid}) is gone: it was killed or lost "
            "its machine first; run the pipeline again"
        )
    return (
        f"the `lmforge run` that started it (pid {pid}) is gone: it was killed or lost its "
        "machine; run the pipeline again to resume"
    )


def _refresh(run_dir: Path, stage_dir: Path, manifest: dict) -> str | None:
    """Ask the stage's launcher about its job (e.g. Slurm's state) and update the manifest."""
    try:
        handle = JobHandle.from_dict(manifest["launcher"])
        launcher = make_launcher(handle.launcher)
        handle = launcher.status(handle)
    except (UserError, OSError, KeyError, ValueError) as err:
        return f"unknown ({err})"
    state = str(handle.state)
    if handle.state.finished or handle.state == JobState.UNKNOWN:
        manifest["launcher"] = handle.to_dict()
        manifest["status"] = STATUS[handle.state]
        manifest["reason"] = handle.reason
        manifest["ended_at"] = manifest.get("ended_at") or now()
        if handle.state == JobState.SUCCEEDED:
            try:
                pipeline = load_pipeline(manifest["pipeline_file"], workdir=manifest["workdir"])
                stage = pipeline.stage(manifest["stage"])
                record_inputs(pipeline, stage, manifest)
                finalize_stage(pipeline, stage, manifest, handle)
            except UserError as err:
                manifest["reason"] = f"finished, but its outputs could not be read: {err}"
        write_manifest(stage_dir, manifest)
    elif manifest.get("status") == "pending" and handle.state == JobState.RUNNING:
        manifest["status"] = "running"
        manifest["started_at"] = manifest.get("started_at") or now()
        write_manifest(stage_dir, manifest)
    return state + (f" ({handle.reason})" if handle.reason else "")


def format_status(statuses: list[StageStatus]) -> str:
    rows = [["stage", "kind", "state", "started", "took", "key metrics / reason"]]
    for s in statuses:
        took = f"{s.duration_s:.1f}s" if isinstance(s.duration_s, int | float) else "-"
        detail = s.reason if s.status not in ("succeeded", "skipped") else _metrics_brief(s)
        state = s.status if s.status != "skipped" else "up to date"
        if s.job and s.job.get("job_id") and s.job.get("launcher") not in (None, "local"):
            state += f" [{s.job['launcher']} {s.job['job_id']}"
            state += f": {s.scheduler_state}]" if s.scheduler_state else "]"
        started = (s.started_at or "-").replace("T", " ").replace("+00:00", "Z")
        rows.append([s.name, s.kind, state, started, took, detail])
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5]
        for row in rows
    )


def _metrics_brief(s: StageStatus) -> str:
    m = s.metrics or {}
    if s.kind in TRAINING_KINDS and "loss" in m:
        first = m.get("first_loss")
        text = (
            f"loss {first:.3f} -> {m['loss']:.3f}"
            if isinstance(first, float)
            else f"loss {m['loss']:.3f}"
        )
        if "tokens_per_s" in m:
            text += f", {m['tokens_per_s']:,.0f} tok/s"
        if m.get("mfu"):
            text += f", mfu {100 * m['mfu']:.1f}%"
        return text
    if s.kind == "eval":
        parts = []
        for label, values in m.items():
            if isinstance(values, dict):
                shown = " ".join(
                    f"{k}={v:.3f}"
                    for k, v in values.items()
                    if isinstance(v, float) and not k.endswith(("_stderr", "acc_norm", "margin"))
                )
                parts.append(f"{label}: {shown}")
        return "; ".join(parts)
    if s.kind in ("quantize", "export") and m.get("bytes"):
        return f"{m['bytes'] / 1e6:.2f} MB" + (f" ({m['scheme']})" if m.get("scheme") else "")
    if s.kind == "generate" and m.get("decode_tokens_per_s"):
        return f"{m['decode_tokens_per_s']:.1f} tok/s decode"
    shown = ", ".join(f"{k} {v}" for k, v in m.items() if isinstance(v, int | float))
    return shown
