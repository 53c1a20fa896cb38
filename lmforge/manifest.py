"""A run directory's records, read by the pipeline, `lmforge status` and the report: each stage's
`manifest.json` (state, inputs, outputs, metrics, lineage), the run's `pipeline.json` (its stage
list) and a training stage's `metrics.jsonl`. Imports nothing of lmforge's, so that every layer
may read them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TRAINING_KINDS = ("pretrain", "sft", "dpo", "grpo")
MANIFEST_NAME = "manifest.json"
PIPELINE_RECORD = "pipeline.json"


def read_manifest(stage_dir: Path) -> dict | None:
    path = stage_dir / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"status": "unknown", "reason": f"{path} is not valid JSON"}


def write_manifest(stage_dir: Path, manifest: dict) -> None:
    """Atomic (write + rename), so a reader never sees half a manifest."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    tmp = stage_dir / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    os.replace(tmp, stage_dir / MANIFEST_NAME)


def read_metrics(stage_dir: Path) -> list[dict]:
    """The training metrics records (metrics.jsonl) of a stage, in order; the last record of a
    step wins when a resumed run logged it again."""
    path = stage_dir / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if isinstance(record, dict) and "step" in record:
            by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


def pipeline_stages(run_dir: Path) -> list[dict]:
    """The stage list of a run directory (from pipeline.json, else its manifests)."""
    record_path = run_dir / PIPELINE_RECORD
    if record_path.exists():
        return json.loads(record_path.read_text())["stages"]
    stages = []
    for manifest_path in sorted(run_dir.glob(f"*/{MANIFEST_NAME}")):
        manifest = json.loads(manifest_path.read_text())
        stages.append(
            {
                "name": manifest.get("stage", manifest_path.parent.name),
                "kind": manifest.get("kind", "?"),
                "from": manifest.get("from"),
            }
        )
    return stages
