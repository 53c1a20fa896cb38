"""A pipeline file read into `Pipeline`: its stages in order, each resolved to the command it
runs (`lmforge COMMAND --config stage.toml`, kinds.py), the config written for it, where its
output goes and which stages and files it reads."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.config import Section, apply_overrides, dump_config, read_config_file
from lmforge.errors import ConfigError, StageOrderError
from lmforge.launch.base import LauncherSection
from lmforge.pipeline.kinds import STAGE_KINDS, StageContext
from lmforge.pipeline.references import References, external_inputs, fingerprint, sha256_text
from lmforge.pipeline.schema import (
    STAGE_CONFIG,
    PipelineFile,
    PipelineSection,
    PlanSection,
    deep_merge,
    refuse_secrets,
    validate_section,
)

RESERVED_STAGE_NAMES = {"data", "model", "pipeline", "launcher", "stages"}
STAGE_KEYS = {"name", "kind", "from", "launcher"}  # the rest of a stage table is its settings
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


@dataclasses.dataclass
class Stage:
    """One resolved stage: its config, its command and where its output goes."""

    name: str
    kind: str
    index: int
    from_stage: str | None
    config: Section
    argv: list[str]  # `COMMAND --config <stage_dir>/stage.toml`, after `lmforge`
    stage_dir: Path  # relative to the pipeline's workdir
    output: Path  # relative to the workdir: what `${name}` and `from = name` mean
    resources: LauncherSection
    depends_on: list[str]
    external_inputs: list[str]  # paths outside the pipeline that the stage reads

    @property
    def distributed(self) -> bool:
        return STAGE_KINDS[self.kind].distributed

    @property
    def config_text(self) -> str:
        return dump_config(self.config)

    @property
    def config_hash(self) -> str:
        payload = {
            "kind": self.kind,
            "config": self.config.model_dump(mode="json"),
            "argv": self.argv,
        }
        return sha256_text(json.dumps(payload, sort_keys=True, separators=(",", ":")))


@dataclasses.dataclass
class Pipeline:
    name: str
    file: Path
    workdir: Path
    run_dir: Path  # relative to workdir: <run_dir>/<name>
    stages: list[Stage]
    section: PipelineSection
    plan_section: PlanSection = dataclasses.field(default_factory=PlanSection)
    # stage name -> why it cannot run on this installation (it and what needs it are skipped)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ConfigError(
            f"{self.file}: no stage named {name!r}; stages: "
            f"{', '.join(s.name for s in self.stages)}"
        )

    def path(self, relative: Path) -> Path:
        return relative if relative.is_absolute() else self.workdir / relative

    def input_fingerprints(self, stage: Stage) -> dict[str, str | None]:
        """The fingerprint of each of `stage`'s inputs: upstream stages' outputs and external
        files."""
        inputs: dict[str, str | None] = {}
        for name in stage.depends_on:
            inputs[f"stage:{name}"] = fingerprint(self.path(self.stage(name).output))
        for path in stage.external_inputs:
            inputs[f"path:{path}"] = fingerprint(self.path(Path(path)))
        return inputs

    def downstream(self, name: str) -> set[str]:
        found = {name}
        for stage in self.stages:
            if found & set(stage.depends_on):
                found.add(stage.name)
        return found - {name}


def load_pipeline(
    path: str | Path, *, workdir: str | Path | None = None, overrides: Sequence[str] = ()
) -> Pipeline:
    """Read and validate a pipeline file (TOML or YAML); every stage's config is resolved and
    checked. `overrides` are `key.sub=value` items applied to the file's data first
    (`stages.sft.train.steps=10`).

    Relative paths (run_dir, data sets, settings) resolve against `workdir` (default: the
    current directory), where the stage commands also run.

    Raises:
        ConfigError: one line per problem, naming the file, the stage and the key.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"pipeline file not found: {file}")
    raw = read_config_file(file)
    _check_override_stages(raw, overrides, file)
    raw = apply_overrides(raw, overrides)
    refuse_secrets(raw, file)
    spec = validate_section(PipelineFile, raw, f"{file}")
    workdir = Path(workdir or Path.cwd()).resolve()
    name = spec.pipeline.name
    if not _NAME.match(name):
        raise ConfigError(f"{file}: pipeline.name {name!r}: use letters, digits, '-' and '_' only")
    run_dir = Path(spec.pipeline.run_dir) / name
    tables = _stage_tables(spec.stages, file)
    all_names = [stage_name for stage_name, _ in tables]
    _refuse_cycles(tables, file)
    unavailable = _unavailable_stages(tables)
    tables = [(stage_name, _without_models(table, unavailable)) for stage_name, table in tables]

    stages: list[Stage] = []
    problems: list[str] = []
    failed: set[str] = set()
    for index, (stage_name, table) in enumerate(tables):
        try:
            stage = _resolve_stage(
                stage_name,
                index,
                table,
                spec=spec,
                file=file,
                run_dir=run_dir,
                earlier=stages,
                all_names=all_names,
                workdir=workdir,
            )
        except ConfigError as err:
            failed.add(stage_name)
            if not (isinstance(err, StageOrderError) and err.stage in failed):
                problems.append(str(err))  # else: the stage it needs has said what is wrong
            continue
        stages.append(stage)
    if problems:
        raise ConfigError("\n".join(problems))
    for stage in stages:  # a ${stage} reference to a skipped stage's output
        skipped = [d for d in stage.depends_on if d in unavailable]
        if skipped and stage.name not in unavailable:
            unavailable[stage.name] = f"it needs stage {skipped[0]!r}, which is skipped"
    return Pipeline(name, file, workdir, run_dir, stages, spec.pipeline, spec.plan, unavailable)


def _unavailable_stages(tables: list[tuple[str, dict]]) -> dict[str, str]:
    """Stages that cannot run on this installation (a kind's `unavailable`, e.g. GPTQ without
    its environment), and those whose `from` is one of them or whose every model is: name ->
    the one line saying why."""
    found: dict[str, str] = {}
    for name, table in tables:
        kind = STAGE_KINDS.get(table.get("kind"))
        reason = kind.unavailable(table) if kind and kind.unavailable else None
        models = table.get("models")
        if reason is None and table.get("from") in found:
            reason = f"it needs stage {table['from']!r}, which is skipped"
        elif reason is None and isinstance(models, list) and models and set(models) <= set(found):
            reason = "every model it reads is skipped"
        if reason:
            found[name] = reason
    return found


def _without_models(table: dict, unavailable: dict[str, str]) -> dict:
    """An eval's table without the models (and their labels) of skipped stages."""
    models = table.get("models")
    if not isinstance(models, list) or not any(m in unavailable for m in models):
        return table
    keep = [i for i, model in enumerate(models) if model not in unavailable]
    table = {**table, "models": [models[i] for i in keep]}
    labels = table.get("labels")
    if isinstance(labels, list) and len(labels) == len(models):
        table["labels"] = [labels[i] for i in keep]
    return table


def _check_override_stages(raw: dict, overrides: Sequence[str], file: Path) -> None:
    """A `stages.NAME.key=value` override may only change a stage the file has."""
    stages = raw.get("stages")
    if isinstance(stages, list):
        names = [str(t.get("name")) for t in stages if isinstance(t, dict)]
    else:
        names = list(stages) if isinstance(stages, dict) else []
    for item in overrides:
        parts = item.partition("=")[0].strip().split(".")
        if len(parts) > 2 and parts[0] == "stages" and parts[1] not in names:
            raise ConfigError(
                f"override {item!r}: {file} has no stage {parts[1]!r}; its stages: "
                f"{', '.join(names) or '(none)'}"
            )


def _stage_needs(table: dict) -> set[str]:
    """The stage names a raw stage table points at: `from` and an eval's `models`."""
    needs = {table["from"]} if isinstance(table.get("from"), str) else set()
    models = table.get("models")
    return needs | (
        {m for m in models if isinstance(m, str)} if isinstance(models, list) else set()
    )


def _refuse_cycles(tables: list[tuple[str, dict]], file: Path) -> None:
    """Stages that need each other's outputs (a cycle: none of them can run first)."""
    needs = {name: _stage_needs(table) for name, table in tables}

    def path_back(start: str, node: str, seen: list[str]) -> list[str] | None:
        for nxt in sorted(needs.get(node, ())):
            if nxt == start:
                return [*seen, nxt]
            if nxt in needs and nxt not in seen:
                found = path_back(start, nxt, [*seen, nxt])
                if found:
                    return found
        return None

    for name, _ in tables:
        cycle = path_back(name, name, [name])
        if cycle:
            raise ConfigError(
                f"{file}: stages {' -> '.join(cycle)} form a cycle (each needs the output of "
                "the next, through from or models): none of them can run first"
            )


def _stage_tables(stages: Any, file: Path) -> list[tuple[str, dict]]:
    tables: list[tuple[str, dict]] = []
    if isinstance(stages, dict):
        for name, table in stages.items():
            if "name" in table and table["name"] != name:
                raise ConfigError(f"{file}: [stages.{name}] has name = {table['name']!r}")
            tables.append((name, {k: v for k, v in table.items() if k != "name"}))
    else:
        for number, table in enumerate(stages, 1):
            if "name" not in table:
                raise ConfigError(f"{file}: [[stages]] entry {number} has no name")
            tables.append((str(table["name"]), {k: v for k, v in table.items() if k != "name"}))
    if not tables:
        raise ConfigError(f"{file}: no stages")
    seen: set[str] = set()
    for name, _ in tables:
        if not _NAME.match(name) or name in RESERVED_STAGE_NAMES:
            raise ConfigError(
                f"{file}: stage name {name!r}: use letters, digits, '-' and '_' (not one of "
                f"{', '.join(sorted(RESERVED_STAGE_NAMES))})"
            )
        if name in seen:
            raise ConfigError(f"{file}: two stages are named {name!r}")
        seen.add(name)
    return tables


def _resolve_stage(
    name: str,
    index: int,
    table: dict,
    *,
    spec: PipelineFile,
    file: Path,
    run_dir: Path,
    earlier: list[Stage],
    all_names: list[str],
    workdir: Path,
) -> Stage:
    """The stage's kind does the kind-specific part (kinds.py); the rest is the same for all."""
    where = f"{file}: stage {name!r}"
    kind = table.get("kind")
    if kind not in STAGE_KINDS:
        raise ConfigError(f"{where}: kind = {kind!r}; allowed: {', '.join(STAGE_KINDS)}")
    outputs = {stage.name: stage.output for stage in earlier}
    from_stage = table.get("from")
    if from_stage is not None and from_stage not in outputs:
        before = f"stages before it: {', '.join(outputs)}" if outputs else "it is the first stage"
        if from_stage in all_names:
            raise StageOrderError(
                f"{where}: from = {from_stage!r} names a stage that comes after it in the file "
                f"(stages run in file order; {before})",
                stage=from_stage,
            )
        raise ConfigError(f"{where}: from = {from_stage!r} names no stage; {before}")
    defaults = spec.launcher
    resources = validate_section(
        LauncherSection, deep_merge(defaults, table.get("launcher", {})), f"{where}: launcher"
    )
    if STAGE_KINDS[kind].one_node and resources.nodes > 1:
        raise ConfigError(
            f"{where}: launcher.nodes = {resources.nodes}: a {kind} stage runs on one node "
            "(tensor parallel over launcher.nproc_per_node GPUs); set launcher.nodes = 1"
        )
    refs = References(outputs, spec.data, where)
    settings = refs.substitute({k: v for k, v in table.items() if k not in STAGE_KEYS})
    stage_dir = run_dir / name
    context = StageContext(
        kind=kind,
        where=where,
        settings=settings,
        from_stage=from_stage,
        outputs=outputs,
        kinds={stage.name: stage.kind for stage in earlier},
        all_names=all_names,
        spec=spec,
        refs=refs,
        stage_dir=stage_dir,
        out_dir=stage_dir / "out",
        artifact_dir=stage_dir / "artifact",
    )
    stage_kind = STAGE_KINDS[kind]
    built = stage_kind.build(context)
    output = context.artifact_dir if stage_kind.output == "artifact" else context.out_dir
    depends = sorted(
        refs.depends | ({from_stage} if from_stage else set()), key=list(outputs).index
    )
    return Stage(
        name=name,
        kind=kind,
        index=index,
        from_stage=from_stage,
        config=built.config,
        argv=[*built.command, "--config", str(stage_dir / STAGE_CONFIG)],
        stage_dir=stage_dir,
        output=output,
        resources=resources,
        depends_on=depends,
        external_inputs=external_inputs(built.config.model_dump(mode="json"), workdir, run_dir),
    )
