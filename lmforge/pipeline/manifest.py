"""A stage's manifest.json as the runner keeps it: written `pending` before the stage starts,
updated from its launcher's job events, and finished with the output's hash and the stage's
key metrics; and the run's pipeline.json. Reading them is lmforge.manifest's job."""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

from lmforge.launch.base import JobHandle, JobState
from lmforge.manifest import PIPELINE_RECORD, read_manifest, write_manifest
from lmforge.pipeline.kinds import STAGE_KINDS
from lmforge.pipeline.references import (
    combined_hash,
    directory_bytes,
    fingerprint,
)
from lmforge.pipeline.spec import Pipeline, Stage

STATUS = {
    JobState.PENDING: "pending",
    JobState.RUNNING: "running",
    JobState.SUCCEEDED: "succeeded",
    JobState.FAILED: "failed",
    JobState.CANCELLED: "cancelled",
    JobState.NOT_STARTED: "not_started",
    JobState.UNKNOWN: "unknown",
}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def write_pipeline_record(pipeline: Pipeline) -> None:
    from lmforge.artifact import code_version

    directory = pipeline.path(pipeline.run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    record = {
        "name": pipeline.name,
        "file": str(pipeline.file.resolve()),
        "workdir": str(pipeline.workdir),
        "run_dir": str(pipeline.run_dir),
        "code_version": code_version(),
        "stages": [
            {
                "name": s.name,
                "kind": s.kind,
                "from": s.from_stage,
                "depends_on": s.depends_on,
                "dir": str(s.stage_dir),
                "output": str(s.output),
            }
            for s in pipeline.stages
        ],
        "updated_at": now(),
    }
    tmp = directory / f".{PIPELINE_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, directory / PIPELINE_RECORD)


def mark_skipped(pipeline: Pipeline, stage: Stage) -> None:
    stage_dir = pipeline.path(stage.stage_dir)
    manifest = read_manifest(stage_dir) or {}
    manifest["status"] = "skipped"
    manifest["reason"] = "up to date"
    manifest["skipped_at"] = now()
    write_manifest(stage_dir, manifest)


def mark_unavailable(pipeline: Pipeline, stage: Stage, reason: str) -> None:
    """A stage that cannot run on this installation: its manifest says why (a previous output
    stays where it is, and the stage runs again once it can)."""
    stage_dir = pipeline.path(stage.stage_dir)
    manifest = {"stage": stage.name, "kind": stage.kind, "pipeline": pipeline.name,
                "depends_on": stage.depends_on, "status": "unavailable", "reason": reason,
                "skipped_at": now()}  # fmt: skip
    write_manifest(stage_dir, manifest)


def pending_manifest(
    pipeline: Pipeline,
    stage: Stage,
    *,
    reason: str,
    resumed: bool,
    launcher: str,
    secret_names: list[str],
) -> dict:
    """A stage's manifest as it is submitted: its config, command and resources, no result yet."""
    from lmforge.artifact import code_version

    return {
        "stage": stage.name,
        "kind": stage.kind,
        "pipeline": pipeline.name,
        "pipeline_file": str(pipeline.file),
        "workdir": str(pipeline.workdir),
        "status": "pending",
        "reason": reason,
        "resumed": resumed,
        "command": ["lmforge", *stage.argv],
        "config": stage.config.model_dump(mode="json"),
        "config_hash": stage.config_hash,
        "resources": stage.resources.model_dump(mode="json"),
        "secrets": secret_names,  # names only
        "from": stage.from_stage,
        "depends_on": stage.depends_on,
        "inputs": {},
        "input_hash": None,
        "input": None,
        "output": {"path": str(stage.output), "hash": None, "bytes": None},
        "metrics": {},
        "code_version": code_version(),
        "launcher": {"name": launcher},
        # who waits on this stage: `lmforge status` tells a killed runner from a live one
        "runner": {"pid": os.getpid(), "host": socket.gethostname()},
        "submitted_at": now(),
        "started_at": None,
        "ended_at": None,
        "duration_s": None,
    }


def record_inputs(pipeline: Pipeline, stage: Stage, manifest: dict) -> None:
    """The fingerprints of the stage's inputs as it starts (what makes it up to date later)."""
    inputs = pipeline.input_fingerprints(stage)
    manifest["inputs"] = inputs
    manifest["input_hash"] = combined_hash(inputs)
    if stage.from_stage:
        upstream = pipeline.stage(stage.from_stage)
        manifest["input"] = {
            "stage": stage.from_stage,
            "path": str(upstream.output),
            "hash": inputs.get(f"stage:{stage.from_stage}"),
        }


def finalize_stage(pipeline: Pipeline, stage: Stage, manifest: dict, handle: JobHandle) -> None:
    """After a success: the stage's key metrics (its kind reads them), the output's hash and
    size."""
    output = pipeline.path(stage.output)
    stage_dir = pipeline.path(stage.stage_dir)
    log = Path(handle.log) if handle.log and Path(handle.log).exists() else stage_dir / "stage.log"
    metrics = STAGE_KINDS[stage.kind].finish(stage_dir, output, log)
    manifest["output"] = {
        "path": str(stage.output),
        "hash": fingerprint(output),
        "bytes": directory_bytes(output) if output.exists() else None,
    }
    manifest["metrics"] = metrics
