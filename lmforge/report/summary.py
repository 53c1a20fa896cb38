"""What a report shows of a run, as data: each stage (`StageInfo`), each artifact
(`ArtifactInfo`) and the whole run (`RunSummary`). `lmforge.report.collect_run` fills them from a
run directory; `lmforge.report.html` renders them (it imports them from here, not from the
package that imports it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class StageInfo:
    name: str
    kind: str
    status: str
    reason: str
    duration_s: float | None
    started_at: str | None
    metrics: dict
    output: str | None
    output_bytes: int | None
    config: dict = dataclasses.field(default_factory=dict)
    """The stage's resolved config (its hyperparameters), as the manifest records it."""
    code_version: str | None = None
    depends_on: list[str] = dataclasses.field(default_factory=list)
    """The stages whose outputs this one reads (the data and model lineage)."""


@dataclasses.dataclass
class ArtifactInfo:
    stage: str
    path: str
    bytes: int
    weight_bytes: int
    scheme: str | None
    lineage_stage: str | None
    parent: str | None
    parent_hash: str | None
    hash: str | None


@dataclasses.dataclass
class RunSummary:
    name: str
    run_dir: Path
    stages: list[StageInfo]
    training: dict[str, list[dict]]  # stage -> metrics.jsonl records
    evals: dict[str, dict[str, dict[str, Any]]]  # eval stage -> model label -> metrics
    eval_sources: dict[str, dict[str, str]]  # eval stage -> model label -> source path
    artifacts: list[ArtifactInfo]
    sample: str | None
    sample_stage: str | None
    eval_answers: dict[str, dict[str, list[dict]]] = dataclasses.field(default_factory=dict)
    """eval stage -> model label -> [{question, answer, reference}] (answer accuracy examples)"""
