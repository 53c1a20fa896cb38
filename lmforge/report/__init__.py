"""`lmforge report RUN_DIR`: what a pipeline run did, as one HTML page and a markdown summary.

`collect_run(run_dir)` reads a run directory (`runs/<pipeline>`: pipeline.json, each stage's
manifest.json, training metrics.jsonl, eval results.json, the artifacts' lmforge.json lineage,
the generated sample) into a `RunSummary`; `write_report` renders it with
`lmforge.report.html` (plots made with matplotlib and embedded as base64 PNG, so the page is one
self-contained file) and as markdown (tables, plus the same plots as PNG files beside it).
"""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.errors import UserError
from lmforge.report.summary import ArtifactInfo, RunSummary, StageInfo

REPORT_HTML = "report.html"
REPORT_MD = "report.md"
ASSETS_DIR = "report_assets"


def collect_run(run_dir: str | Path) -> RunSummary:
    """Everything the report shows, read from a run directory."""
    from lmforge.manifest import (
        PIPELINE_RECORD,
        TRAINING_KINDS,
        pipeline_stages,
        read_manifest,
        read_metrics,
    )

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory (expected runs/<pipeline>)")
    entries = pipeline_stages(run_dir)
    if not entries:
        raise UserError(f"{run_dir}: no {PIPELINE_RECORD} and no stage manifests; run a pipeline")
    record_path = run_dir / PIPELINE_RECORD
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    workdir = Path(record.get("workdir", "."))
    name = record.get("name", run_dir.name)

    stages: list[StageInfo] = []
    training: dict[str, list[dict]] = {}
    evals: dict[str, dict] = {}
    eval_sources: dict[str, dict] = {}
    eval_answers: dict[str, dict] = {}
    artifacts: list[ArtifactInfo] = []
    sample = sample_stage = None
    for entry in entries:
        stage_dir = run_dir / entry["name"]
        manifest = read_manifest(stage_dir) or {}
        kind = manifest.get("kind", entry.get("kind", "?"))
        output = (manifest.get("output") or {}).get("path") or entry.get("output")
        output_dir = _locate(output, workdir, stage_dir)
        stages.append(
            StageInfo(
                name=entry["name"],
                kind=kind,
                status=manifest.get("status", "never run"),
                reason=manifest.get("reason", ""),
                duration_s=manifest.get("duration_s"),
                started_at=manifest.get("started_at"),
                metrics=manifest.get("metrics") or {},
                output=output,
                output_bytes=(manifest.get("output") or {}).get("bytes"),
                config=manifest.get("config") or {},
                code_version=manifest.get("code_version"),
                depends_on=list(manifest.get("depends_on") or entry.get("depends_on") or []),
            )
        )
        if kind in TRAINING_KINDS:
            records = read_metrics(stage_dir)
            if records:
                training[entry["name"]] = records
        if kind == "eval" and output_dir is not None and (output_dir / "results.json").exists():
            data = json.loads((output_dir / "results.json").read_text())
            evals[entry["name"]] = {k: v.get("metrics", {}) for k, v in data["models"].items()}
            eval_sources[entry["name"]] = {k: v.get("source") for k, v in data["models"].items()}
            answers = {k: v["answers"] for k, v in data["models"].items() if v.get("answers")}
            if answers:
                eval_answers[entry["name"]] = answers
        if kind == "generate" and output_dir is not None and (output_dir / "sample.txt").exists():
            sample, sample_stage = (output_dir / "sample.txt").read_text(), entry["name"]
        if output_dir is not None and (output_dir / "lmforge.json").exists():
            artifacts.append(_artifact_info(entry["name"], output, output_dir))
    return RunSummary(
        name,
        run_dir,
        stages,
        training,
        evals,
        eval_sources,
        artifacts,
        sample,
        sample_stage,
        eval_answers,
    )


def _locate(output: str | None, workdir: Path, stage_dir: Path) -> Path | None:
    if not output:
        return None
    path = Path(output)
    for candidate in (path, workdir / path, stage_dir / path.name):
        if candidate.exists():
            return candidate
    return None


def _artifact_info(stage: str, output: str, directory: Path) -> ArtifactInfo:
    lineage = json.loads((directory / "lmforge.json").read_text())
    parent = lineage.get("parent") or {}
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return ArtifactInfo(
        stage=stage,
        path=output,
        bytes=total,
        weight_bytes=weights,
        scheme=(lineage.get("quantization") or {}).get("scheme"),
        lineage_stage=lineage.get("stage"),
        parent=parent.get("source"),
        parent_hash=parent.get("hash"),
        hash=lineage.get("hash"),
    )


def write_report(run_dir: str | Path, *, out: str | Path | None = None) -> dict[str, Path]:
    """Write report.html (self-contained) and report.md (+ report_assets/*.png) for a run.

    Returns:
        {"html": path, "markdown": path}.
    """
    from lmforge.launch.base import load_secrets, redact
    from lmforge.report.html import make_figures, render_html, render_markdown

    summary = collect_run(run_dir)
    out_dir = Path(out) if out is not None else summary.run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = make_figures(summary)
    assets = out_dir / ASSETS_DIR
    assets.mkdir(exist_ok=True)
    for figure in figures:
        (assets / f"{figure.key}.png").write_bytes(figure.png)
    secrets = load_secrets()  # never let a value that happens to be in the data through
    html_path = out_dir / REPORT_HTML
    html_path.write_text(redact(render_html(summary, figures), secrets), encoding="utf-8")
    md_path = out_dir / REPORT_MD
    md_path.write_text(
        redact(render_markdown(summary, figures, ASSETS_DIR), secrets), encoding="utf-8"
    )
    return {"html": html_path, "markdown": md_path}


__all__ = ["ArtifactInfo", "RunSummary", "StageInfo", "collect_run", "write_report"]
