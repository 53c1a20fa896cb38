"""The pipeline runner: one TOML file, an ordered list of stages, each feeding the next.

A pipeline file names the pipeline, the model to start from, data sets and the stages:

    [pipeline]
    name = "tiny"                      # stages run in <run_dir>/<name>/<stage>/ (run_dir: runs)
    [model]
    source = "tiny"                    # preset or path; training stages without `from` use it
    tokenizer = "${tokenizer}"         # ${STAGE} is that stage's output (a dependency)
    [data.sft_train]
    path = "${world}/sft_train.jsonl"  # ${data.NAME} in a stage setting is this path
    [launcher]                         # defaults for every stage's [stages.X.launcher]
    nodes = 1
    [plan]                             # plan each training stage's GPU memory before it runs
    gpu_memory = "h200"                # (lmforge plan's arithmetic); warn when it will not fit
    [stages.sft]                       # or [[stages]] with name = "sft"; file order is run order
    kind = "sft"                       # prepare|tokenizer|pretrain|sft|dpo|eval|quantize|generate|export
    from = "pretrain"                  # the input artifact: another stage's output
    data.path = "${data.sft_train}"    # the stage's own settings (for training: the job config)
    train.steps = 100
    launcher.nproc_per_node = 2        # resources (lmforge.launch.base.LauncherSection)

Every stage becomes an lmforge command line (`StageJob`: e.g. `lmforge sft --config
runs/tiny/sft/stage.toml`) with its resolved config written beside it, so any launcher (local,
Slurm, Kubernetes) can run it. Each stage directory holds `manifest.json`: the resolved config and
its hash, the input artifacts and their hashes, the code version, the status (pending, running,
succeeded, failed, not_started, cancelled, skipped), timings, key metrics and the output artifact
with its hash. Like `make`, a stage whose config and inputs equal those of its last success (and
whose output is still there) is skipped; a stage that runs makes every stage downstream of it run.

Secrets (HF_TOKEN, WANDB_API_KEY, LMFORGE_API_KEY) come from the environment or a secrets file
and reach the jobs through their environment only (lmforge.launch.base); they are refused in
the pipeline file and never written to manifests, configs or scripts.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import Field, PositiveInt, field_validator

from lmforge.config import (
    ModelSection,
    Section,
    apply_overrides,
    drop_none,
    dump_config,
    load_config,
    read_config_file,
)
from lmforge.data.prepare import PrepareSection
from lmforge.errors import ConfigError, UserError
from lmforge.launch.base import (
    SECRET_NAMES,
    JobHandle,
    JobState,
    Launcher,
    LauncherSection,
    StageJob,
    load_secrets,
    make_launcher,
    redact,
)
from lmforge.manifest import (
    PIPELINE_RECORD,
    TRAINING_KINDS,
    pipeline_stages,
    read_manifest,
    read_metrics,
    write_manifest,
)
from lmforge.procs import process_alive
from lmforge.quantize.schemes import SCHEMES

STAGE_KINDS = (
    "prepare",
    "tokenizer",
    "pretrain",
    "sft",
    "dpo",
    "eval",
    "quantize",
    "generate",
    "export",
)
STAGE_CONFIG = "stage.toml"
SAMPLE_NAME = "sample.txt"
RESERVED_STAGE_NAMES = {"data", "model", "pipeline", "launcher", "stages"}
STAGE_KEYS = {"name", "kind", "from", "launcher"}  # the rest of a stage table is its settings
# Files bigger than this are fingerprinted by size and mtime instead of content.
CONTENT_HASH_MAX_BYTES = 64 * 1024**2
_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


# ----------------------------------------------------------------------------- file schema


class PipelineSection(Section):
    name: str
    """Stages run in `<run_dir>/<name>/<stage>/`."""
    run_dir: str = "runs"
    secrets_file: str | None = None
    """A file of `NAME=VALUE` lines for HF_TOKEN / WANDB_API_KEY / LMFORGE_API_KEY (the
    environment wins). Only its path is recorded, never its content."""
    report: bool = True
    """Write the HTML + markdown report (`lmforge report`) when a run succeeds."""
    description: str = ""


class DataSetSection(Section):
    path: str | list[str]
    description: str = ""


class PlanSection(Section):
    """How `lmforge run` checks that the training stages fit their GPUs (`lmforge plan`)."""

    gpu_memory: str | None = None
    """Memory of one GPU: 80GB, 141GB, or a name (h100, h200, a100-80gb, ...). Unset: the local
    GPU's with the local launcher; elsewhere the stages are not planned."""
    host_memory: str | None = None
    """Host memory of one node (CPU offload, loading the weights); unset: 256 GiB per GPU."""
    model: str | None = None
    """The shape to plan with while `[model] source` is not on disk yet: a preset (e.g.
    llama3.1-70b) or a config directory."""

    @field_validator("gpu_memory", "host_memory")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        from lmforge.plan.memory import parse_memory

        if value is not None:
            try:
                parse_memory(value)
            except ConfigError as err:
                raise ValueError(str(err)) from None
        return value


class PipelineFile(Section):
    pipeline: PipelineSection
    model: ModelSection = Field(default_factory=ModelSection)
    plan: PlanSection = Field(default_factory=PlanSection)
    data: dict[str, DataSetSection] = Field(default_factory=dict)
    launcher: dict[str, Any] = Field(default_factory=dict)
    stages: dict[str, dict[str, Any]] | list[dict[str, Any]]


class DemoDataSection(Section):
    """`lmforge.data.demo.write_demo_data` settings (a prepare stage with `demo = {...}`)."""

    seed: int = 0
    num_people: PositiveInt | None = None
    repeats: PositiveInt | None = None


class DemoPrepareSection(Section):
    demo: DemoDataSection = Field(default_factory=DemoDataSection)


class TokenizerStageSection(Section):
    input: list[str]
    vocab_size: PositiveInt
    min_frequency: PositiveInt = 2


class EvalStageSection(Section):
    """Side-by-side evaluation of several models (`lmforge pipeline-eval`)."""

    models: list[str] = Field(default_factory=list)
    """Stage names (or model paths); empty: the `from` stage."""
    labels: list[str] = Field(default_factory=list)
    """Names shown for `models` (default: the stage names / directory names)."""
    tasks: list[str] = Field(default_factory=list)
    """lm-eval tasks scored on plain text."""
    chat_tasks: list[str] = Field(default_factory=list)
    """lm-eval tasks scored with each model's chat template."""
    include_path: list[str] = Field(default_factory=list)
    demo_data: str | None = None
    """The demo's mc_heldout.jsonl: makes the tasks demo_mc and demo_mc_chat available."""
    preference_data: str | None = None
    """(prompt, chosen, rejected) rows: adds `preference/accuracy` per model."""
    answer_data: str | None = None
    """Chat conversations ending in a reference answer: adds `answers/exact_match` (greedy
    generation in the chat format, lmforge.eval.answers)."""
    perplexity: list[str] = Field(default_factory=list)
    limit: float | None = None
    batch_size: PositiveInt = 8
    device: str = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    num_fewshot: int | None = None
    out: str = ""
    """Set by the pipeline: where results.json goes."""


class QuantizeStageSection(Section):
    scheme: Literal[SCHEMES]
    group_size: PositiveInt | None = None
    quantize_output: bool = False
    device: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None


class GenerateStageSection(Section):
    prompt: list[str] = Field(default_factory=list)
    chat: list[str] = Field(default_factory=list)
    system: str | None = None
    max_new_tokens: PositiveInt = 64
    temperature: float = Field(0.0, ge=0)
    top_k: PositiveInt | None = None
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None


class ExportStageSection(Section):
    dtype: Literal["float32", "bfloat16"] = "bfloat16"


def training_schema(kind: str) -> type[Section]:
    from lmforge.train.config import DPOJob, PretrainJob, SFTJob

    return {"pretrain": PretrainJob, "sft": SFTJob, "dpo": DPOJob}[kind]


# ----------------------------------------------------------------------------- the model


@dataclasses.dataclass
class Stage:
    """One resolved stage: its config, its command and where its output goes."""

    name: str
    kind: str
    index: int
    from_stage: str | None
    config: Section
    argv: list[str]
    stage_dir: Path  # relative to the pipeline's workdir
    output: Path  # relative to the workdir: what `${name}` and `from = name` mean
    resources: LauncherSection
    depends_on: list[str]
    external_inputs: list[str]  # paths outside the pipeline that the stage reads

    @property
    def distributed(self) -> bool:
        return self.kind in TRAINING_KINDS

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
        return _sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")))


@dataclasses.dataclass
class Pipeline:
    name: str
    file: Path
    workdir: Path
    run_dir: Path  # relative to workdir: <run_dir>/<name>
    stages: list[Stage]
    section: PipelineSection
    plan_section: PlanSection = dataclasses.field(default_factory=PlanSection)

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

    def downstream(self, name: str) -> set[str]:
        found = {name}
        for stage in self.stages:
            if found & set(stage.depends_on):
                found.add(stage.name)
        return found - {name}


# ----------------------------------------------------------------------------- loading


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
    raw = apply_overrides(read_config_file(file), overrides)
    _refuse_secrets(raw, file)
    spec = _validate(PipelineFile, raw, f"{file}")
    workdir = Path(workdir or Path.cwd()).resolve()
    name = spec.pipeline.name
    if not _NAME.match(name):
        raise ConfigError(f"{file}: pipeline.name {name!r}: use letters, digits, '-' and '_' only")
    run_dir = Path(spec.pipeline.run_dir) / name
    tables = _stage_tables(spec.stages, file)
    defaults = spec.launcher

    stages: list[Stage] = []
    outputs: dict[str, Path] = {}
    problems: list[str] = []
    all_names = [stage_name for stage_name, _ in tables]
    for index, (stage_name, table) in enumerate(tables):
        where = f"{file}: stage {stage_name!r}"
        try:
            stage = _resolve_stage(
                stage_name,
                index,
                table,
                where=where,
                run_dir=run_dir,
                outputs=outputs,
                spec=spec,
                defaults=defaults,
                stages=stages,
                all_names=all_names,
                workdir=workdir,
            )
        except ConfigError as err:
            problems.append(str(err))
            continue
        stages.append(stage)
        outputs[stage_name] = stage.output
    if problems:
        raise ConfigError("\n".join(problems))
    return Pipeline(name, file, workdir, run_dir, stages, spec.pipeline, spec.plan)


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
    where: str,
    run_dir: Path,
    outputs: dict[str, Path],
    spec: PipelineFile,
    defaults: dict,
    stages: list[Stage],
    all_names: list[str],
    workdir: Path,
) -> Stage:
    kind = table.get("kind")
    if kind not in STAGE_KINDS:
        raise ConfigError(f"{where}: kind = {kind!r}; allowed: {', '.join(STAGE_KINDS)}")
    from_stage = table.get("from")
    if from_stage is not None and from_stage not in outputs:
        later = from_stage in all_names
        raise ConfigError(
            f"{where}: from = {from_stage!r} names "
            + ("a stage that comes after it" if later else "no earlier stage")
            + f"; earlier stages: {', '.join(outputs) or '(none)'}"
        )
    resources = _validate(
        LauncherSection, _deep_merge(defaults, table.get("launcher", {})), f"{where}: launcher"
    )
    settings = {k: v for k, v in table.items() if k not in STAGE_KEYS}
    refs = _References(outputs, spec.data, where)
    settings = refs.substitute(settings)
    stage_dir = run_dir / name
    out_dir = stage_dir / "out"
    artifact_dir = stage_dir / "artifact"
    config_path = str(stage_dir / STAGE_CONFIG)
    from_output = outputs.get(from_stage) if from_stage else None

    def needs_from() -> Path:
        if from_output is None:
            raise ConfigError(f"{where}: a {kind} stage needs from = STAGE (its input model)")
        return from_output

    def own(key: str) -> None:
        if key in settings:
            raise ConfigError(f"{where}: {key!r} is set by the pipeline; remove it")

    config: Section
    if kind in TRAINING_KINDS:
        own("run_dir")
        data = {}
        if from_output is not None:
            data["model"] = {"source": str(from_output)}
        else:
            model = refs.substitute(spec.model.model_dump(mode="json", exclude_none=True))
            data["model"] = {k: v for k, v in model.items() if v not in ({}, None)}
        data = _deep_merge(data, settings)
        data["run_dir"] = str(stage_dir)
        config = _validate_file(training_schema(kind), data, where)
        try:
            config.require_data()
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        output = artifact_dir
        argv = [kind, "--config", config_path]
    elif kind == "prepare":
        if "demo" in settings:
            demo = settings["demo"]
            config = _validate(DemoPrepareSection, {"demo": {} if demo is True else demo}, where)
            argv = ["demo", "--write-data", str(out_dir)]
            for key, value in config.demo.model_dump(exclude_none=True).items():
                argv += [f"--{key.replace('_', '-')}", str(value)]
        else:
            own("out")
            data = {"workers": 1, **settings, "out": str(out_dir)}
            config = _validate_file(PrepareSection, data, where)
            argv = ["prepare", "--config", config_path]
        output = out_dir
    elif kind == "tokenizer":
        config = _validate(TokenizerStageSection, settings, where)
        argv = [
            "tokenizer",
            "train",
            "--input",
            *config.input,
            "--vocab-size",
            str(config.vocab_size),
            "--min-frequency",
            str(config.min_frequency),
            "--out",
            str(out_dir),
        ]
        output = out_dir
    elif kind == "eval":
        own("out")
        models = settings.get("models") or ([from_stage] if from_stage else [])
        if not models:
            raise ConfigError(f"{where}: name the models to evaluate (models = [...] or from)")
        labels = settings.get("labels") or [Path(m).name for m in models]
        resolved = [str(outputs[m]) if m in outputs else m for m in models]
        refs.depends.update(m for m in models if m in outputs)
        for model in models:
            if model in all_names and model not in outputs:
                raise ConfigError(f"{where}: models: stage {model!r} comes after it")
        data = {**settings, "models": resolved, "labels": labels, "out": str(out_dir)}
        config = _validate(EvalStageSection, data, where)
        if len(config.labels) != len(config.models):
            raise ConfigError(
                f"{where}: labels has {len(config.labels)} names for {len(config.models)} models"
            )
        if not (
            config.tasks
            or config.chat_tasks
            or config.preference_data
            or config.answer_data
            or config.perplexity
        ):
            raise ConfigError(
                f"{where}: nothing to evaluate: set tasks, chat_tasks, "
                "preference_data, answer_data or perplexity"
            )
        argv = ["pipeline-eval", "--config", config_path]
        output = out_dir
    elif kind == "quantize":
        config = _validate(QuantizeStageSection, settings, where)
        argv = ["quantize", str(needs_from()), str(artifact_dir), "--scheme", config.scheme]
        if config.group_size:
            argv += ["--group-size", str(config.group_size)]
        if config.quantize_output:
            argv.append("--quantize-output")
        for key in ("device", "dtype"):
            if getattr(config, key):
                argv += [f"--{key}", getattr(config, key)]
        output = artifact_dir
    elif kind == "generate":
        config = _validate(GenerateStageSection, settings, where)
        if bool(config.prompt) == bool(config.chat):
            raise ConfigError(f"{where}: set exactly one of prompt = [...] or chat = [...]")
        argv = ["generate", str(needs_from())]
        argv += ["--chat", *config.chat] if config.chat else ["--prompt", *config.prompt]
        if config.system:
            argv += ["--system", config.system]
        argv += [
            "--max-new-tokens",
            str(config.max_new_tokens),
            "--temperature",
            str(config.temperature),
            "--top-p",
            str(config.top_p),
            "--seed",
            str(config.seed),
            "--device",
            config.device,
        ]
        if config.top_k:
            argv += ["--top-k", str(config.top_k)]
        if config.dtype:
            argv += ["--dtype", config.dtype]
        output = out_dir
    else:  # export: a training stage's newest checkpoint as an artifact
        config = _validate(ExportStageSection, settings, where)
        if (
            from_stage is None
            or stages[[s.name for s in stages].index(from_stage)].kind not in TRAINING_KINDS
        ):
            raise ConfigError(f"{where}: an export stage needs from = a training stage")
        argv = ["export", str(run_dir / from_stage), str(artifact_dir), "--dtype", config.dtype]
        output = artifact_dir

    depends = sorted(
        refs.depends | ({from_stage} if from_stage else set()), key=list(outputs).index
    )
    return Stage(
        name=name,
        kind=kind,
        index=index,
        from_stage=from_stage,
        config=config,
        argv=argv,
        stage_dir=stage_dir,
        output=output,
        resources=resources,
        depends_on=depends,
        external_inputs=_external_inputs(config.model_dump(mode="json"), workdir, run_dir),
    )


def _external_inputs(config: Any, workdir: Path, run_dir: Path) -> list[str]:
    """Setting values that name existing files or directories outside the run directory:
    inputs whose content decides whether the stage is up to date."""
    found: set[str] = set()
    runs = (workdir / run_dir).resolve()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str) and value and "\n" not in value and len(value) < 4096:
            path = Path(value)
            full = path if path.is_absolute() else workdir / path
            try:
                exists = full.exists()
                inside = full.resolve().is_relative_to(runs)  # a stage's output: a dependency
            except (OSError, ValueError):
                return
            if exists and not inside and full.resolve() != workdir:
                found.add(value)

    walk(config)
    return sorted(found)


class _References:
    """Replaces `${stage}` and `${data.NAME}` in settings, collecting the dependencies."""

    def __init__(self, outputs: dict[str, Path], data: dict[str, DataSetSection], where: str):
        self.outputs, self.data, self.where = outputs, data, where
        self.depends: set[str] = set()
        self.external: set[str] = set()

    def substitute(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.substitute(v) for k, v in value.items()}
        if isinstance(value, list):
            out: list = []
            for item in value:
                new = self.substitute(item)
                # "${data.x}" naming a list of files splices it into the list
                if isinstance(item, str) and isinstance(new, list):
                    out.extend(new)
                else:
                    out.append(new)
            return out
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _REFERENCE.fullmatch(value)
        if whole:
            return self._lookup(whole.group(1))

        def one(match: re.Match) -> str:
            found = self._lookup(match.group(1))
            if isinstance(found, list):
                raise ConfigError(
                    f"{self.where}: ${{{match.group(1)}}} is a list of paths; "
                    "use it as a whole value"
                )
            return found

        return _REFERENCE.sub(one, value)

    def _lookup(self, key: str) -> str | list[str]:
        if key.startswith("data."):
            name = key.removeprefix("data.")
            if name not in self.data:
                raise ConfigError(
                    f"{self.where}: ${{{key}}}: no data set {name!r}; data sets: "
                    f"{', '.join(self.data) or '(none)'}"
                )
            path = self.data[name].path
            values = [self.substitute(p) for p in ([path] if isinstance(path, str) else path)]
            return values[0] if isinstance(path, str) else values
        if key in self.outputs:
            self.depends.add(key)
            return str(self.outputs[key])
        raise ConfigError(
            f"{self.where}: ${{{key}}} names no earlier stage and no data set (stages before "
            f"it: {', '.join(self.outputs) or '(none)'}; data sets: ${{data.NAME}})"
        )


def _validate(schema: type[Section], data: Any, where: str):
    """Validate plain data against a Section; errors as `WHERE: key: problem` lines."""
    import pydantic

    try:
        return schema.model_validate(data)
    except pydantic.ValidationError as err:
        lines = []
        for problem in err.errors():
            key = ".".join(str(p) for p in problem["loc"]) or "(top level)"
            if problem["type"] == "extra_forbidden":
                allowed = ", ".join(_allowed_keys(schema, problem["loc"][:-1]))
                lines.append(f"{where}: unknown key {key!r}; allowed: {allowed}")
            elif problem["type"] == "missing":
                lines.append(f"{where}: {key} is required")
            else:
                message = problem["msg"].removeprefix("Value error, ")
                message = message.replace("Input should be ", "must be ", 1)
                lines.append(f"{where}: {key} = {problem.get('input')!r}: {message}")
        raise ConfigError("\n".join(lines)) from None


def _allowed_keys(schema: type[Section], loc: tuple) -> list[str]:
    import typing

    current: Any = schema
    for part in loc:
        if isinstance(part, int) or not (
            isinstance(current, type) and issubclass(current, Section)
        ):
            return []
        field = current.model_fields.get(str(part))
        if field is None:
            return []
        current = field.annotation
        for arg in typing.get_args(current) or ():
            if isinstance(arg, type) and issubclass(arg, Section):
                current = arg
    if isinstance(current, type) and issubclass(current, Section):
        return sorted(current.model_fields)
    return []


def _validate_file(schema: type[Section], data: dict, where: str) -> Section:
    """Validate through `load_config` (its messages name the key and what is allowed), with
    the temporary file's name replaced by the stage's."""
    with tempfile.TemporaryDirectory(prefix="lmforge-stage-") as tmp:
        path = Path(tmp) / STAGE_CONFIG
        path.write_text(tomli_w.dumps(drop_none(data)))
        try:
            return load_config(schema, path)
        except ConfigError as err:
            text = re.sub(rf" \({re.escape(str(path))}:\d+\)", "", str(err))
            text = text.replace(str(path), "stage settings")
            raise ConfigError("\n".join(f"{where}: {line}" for line in text.splitlines())) from None


def _refuse_secrets(raw: Any, file: Path, key: str = "") -> None:
    """Secrets belong in the environment or a secrets file, never in the pipeline file."""
    if isinstance(raw, dict):
        for name, value in raw.items():
            dotted = f"{key}.{name}" if key else name
            if name in SECRET_NAMES:
                raise ConfigError(
                    f"{file}: {dotted}: secrets must not be written in the pipeline file; set "
                    f"{name} in the environment or in a file named by pipeline.secrets_file / "
                    "--secrets-file"
                )
            _refuse_secrets(value, file, dotted)
    elif isinstance(raw, list):
        for item in raw:
            _refuse_secrets(item, file, key)


def _deep_merge(base: Mapping, override: Mapping) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- fingerprints


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint(path: Path) -> str | None:
    """A content fingerprint of a file or directory (None when absent). An artifact's is its
    recorded hash; files above 64 MiB count by size and modification time."""
    from lmforge.artifact import LINEAGE_NAME, artifact_hash

    if not path.exists():
        return None
    if path.is_dir() and (path / LINEAGE_NAME).exists():
        return artifact_hash(path)
    if path.is_file():
        return _file_fingerprint(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path)
        if any(part.startswith(".") for part in relative.parts):
            continue
        digest.update(f"{relative.as_posix()}:{_file_fingerprint(file)}\n".encode())
    return digest.hexdigest()


def _file_fingerprint(path: Path) -> str:
    stat = path.stat()
    if stat.st_size > CONTENT_HASH_MAX_BYTES:
        return f"stat:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def directory_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- manifests


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- planning


@dataclasses.dataclass
class PlanItem:
    stage: Stage
    action: Literal["run", "skip", "keep"]
    """run: will run; skip: up to date; keep: not selected (--only/--from), left as it is."""
    reason: str
    input_hash: str | None = None


def input_fingerprints(pipeline: Pipeline, stage: Stage) -> dict[str, str | None]:
    """The fingerprint of each input: upstream stages' outputs and external files."""
    inputs: dict[str, str | None] = {}
    for name in stage.depends_on:
        inputs[f"stage:{name}"] = fingerprint(pipeline.path(pipeline.stage(name).output))
    for path in stage.external_inputs:
        inputs[f"path:{path}"] = fingerprint(pipeline.path(Path(path)))
    return inputs


def combined_hash(inputs: Mapping[str, str | None]) -> str:
    return _sha256(json.dumps(dict(sorted(inputs.items())), separators=(",", ":")))


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
        input_hash = combined_hash(input_fingerprints(pipeline, stage))
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


# ----------------------------------------------------------------------------- running


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
        label = {"run": "run", "skip": "up to date", "keep": "left as is"}[item.action]
        detail = f" ({item.reason})" if item.action == "run" else ""
        echo(f"  {item.stage.name:<14} {item.stage.kind:<9} {label}{detail}")
    plan_files = _plan_memory(pipeline, [item.stage for item in to_run], launcher.name, echo)
    if dry_run:
        for item, job in zip(to_run, jobs):
            echo(f"\n# stage {job.name} ({job.kind})")
            echo(f"$ lmforge {_quote(job.argv)}")
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

    _write_pipeline_record(pipeline)
    for item in plan:
        if item.action == "skip":
            echo(f"[pipeline] {item.stage.name}: up to date, skipped")
            _mark_skipped(pipeline, item.stage)
    if not jobs:
        echo("[pipeline] everything is up to date")
        report = _maybe_report(pipeline, echo)
        return RunResult(pipeline, plan, {}, ok=True, report=report)

    tracker = _Tracker(pipeline, {i.stage.name: i for i in to_run}, launcher, secrets, echo)
    for item, job in zip(to_run, jobs):
        tracker.prepare(item, job, plan_files.get(job.name, {}))
    handles: dict[str, JobHandle] = {}
    try:
        handles = launcher.submit(jobs, secrets=secrets, on_event=tracker.event)
        if wait:
            handles = launcher.wait(handles, on_event=tracker.event)
    except KeyboardInterrupt:
        tracker.interrupted()
        raise
    for handle in handles.values():
        if handle.state.finished:
            tracker.event(handle)
    ok = all(h.state == JobState.SUCCEEDED for h in handles.values())
    finished = all(h.state.finished for h in handles.values())
    report = None
    if ok:
        echo(f"[pipeline] {pipeline.name}: all {len(jobs)} stage(s) succeeded")
        report = _maybe_report(pipeline, echo)
    elif finished:
        failed = [h for h in handles.values() if h.state in (JobState.FAILED, JobState.CANCELLED)]
        for handle in failed:
            echo(f"[pipeline] stage {handle.name} {handle.state}: {handle.reason}")
        echo(f"[pipeline] details: lmforge status {pipeline.run_dir}")
    else:
        echo(f"[pipeline] submitted; follow with: lmforge status {pipeline.run_dir}")
    return RunResult(pipeline, plan, handles, ok=ok, report=report)


def _plan_memory(
    pipeline: Pipeline, stages: list[Stage], launcher: str, echo: Callable[[str], None]
) -> dict[str, dict[str, str]]:
    """Plan the GPU memory of the training stages about to run (warning about those that will
    not fit) and return each planned stage's table as a file for its directory."""
    from lmforge.plan.report import format_plan
    from lmforge.plan.stages import PLAN_FILE, format_stage_plans, plan_stages

    plans = [p for p in plan_stages(pipeline, stages, launcher) if p.skipped != "runs on the CPU"]
    if not plans:
        return {}
    echo("")
    for line in format_stage_plans(plans):
        echo(line)
    return {
        p.stage.name: {PLAN_FILE: format_plan(p.plan) + "\n"} for p in plans if p.plan is not None
    }


def _quote(argv: list[str]) -> str:
    import shlex

    return shlex.join(argv)


def _maybe_report(pipeline: Pipeline, echo: Callable[[str], None]) -> Path | None:
    if not pipeline.section.report:
        return None
    from lmforge.report import write_report

    paths = write_report(pipeline.path(pipeline.run_dir))
    echo(f"[pipeline] report: {paths['html']} (summary: {paths['markdown']})")
    return paths["html"]


def _write_pipeline_record(pipeline: Pipeline) -> None:
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
        "updated_at": _now(),
    }
    tmp = directory / f".{PIPELINE_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, directory / PIPELINE_RECORD)


def _mark_skipped(pipeline: Pipeline, stage: Stage) -> None:
    stage_dir = pipeline.path(stage.stage_dir)
    manifest = read_manifest(stage_dir) or {}
    manifest["status"] = "skipped"
    manifest["reason"] = "up to date"
    manifest["skipped_at"] = _now()
    write_manifest(stage_dir, manifest)


class _Tracker:
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
        from lmforge.artifact import code_version

        stage = item.stage
        stage_dir = job.run_dir
        old = read_manifest(stage_dir) or {}
        resumable = (
            stage.kind in TRAINING_KINDS
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
        manifest = {
            "stage": stage.name,
            "kind": stage.kind,
            "pipeline": self.pipeline.name,
            "pipeline_file": str(self.pipeline.file),
            "workdir": str(self.pipeline.workdir),
            "status": "pending",
            "reason": item.reason,
            "resumed": resumable,
            "command": ["lmforge", *stage.argv],
            "config": stage.config.model_dump(mode="json"),
            "config_hash": stage.config_hash,
            "resources": stage.resources.model_dump(mode="json"),
            "secrets": sorted(self.secrets),  # names only
            "from": stage.from_stage,
            "depends_on": stage.depends_on,
            "inputs": {},
            "input_hash": None,
            "input": None,
            "output": {"path": str(stage.output), "hash": None, "bytes": None},
            "metrics": {},
            "code_version": code_version(),
            "launcher": {"name": self.launcher.name},
            # who waits on this stage: `lmforge status` tells a killed runner from a live one
            "runner": {"pid": os.getpid(), "host": socket.gethostname()},
            "submitted_at": _now(),
            "started_at": None,
            "ended_at": None,
            "duration_s": None,
        }
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
        manifest["status"] = _STATUS[handle.state]
        name = handle.name
        if handle.state == JobState.RUNNING:
            manifest["started_at"] = _now()
            manifest["started_unix"] = time.time()
            self._record_inputs(item.stage, manifest)
            job_id = f" (job {handle.job_id})" if handle.job_id else ""
            self.echo(f"[pipeline] {name}: running{job_id}: lmforge {_quote(item.stage.argv)}")
        elif handle.state.finished:
            manifest["reason"] = redact(handle.reason, self.secrets)
            if handle.state != JobState.NOT_STARTED:
                manifest["ended_at"] = _now()
                if manifest.get("started_unix"):
                    manifest["duration_s"] = round(time.time() - manifest["started_unix"], 2)
            if handle.state == JobState.SUCCEEDED:
                if not manifest.get("input_hash"):
                    self._record_inputs(item.stage, manifest)
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

    def _record_inputs(self, stage: Stage, manifest: dict) -> None:
        inputs = input_fingerprints(self.pipeline, stage)
        manifest["inputs"] = inputs
        manifest["input_hash"] = combined_hash(inputs)
        if stage.from_stage:
            upstream = self.pipeline.stage(stage.from_stage)
            manifest["input"] = {
                "stage": stage.from_stage,
                "path": str(upstream.output),
                "hash": inputs.get(f"stage:{stage.from_stage}"),
            }

    def interrupted(self) -> None:
        for name, item in self.items.items():
            if self.seen.get(name, JobState.PENDING).finished:
                continue
            stage_dir = self.pipeline.path(item.stage.stage_dir)
            manifest = read_manifest(stage_dir) or {}
            if manifest.get("status") in ("pending", "running"):
                manifest["status"] = (
                    "cancelled" if manifest["status"] == "running" else "not_started"
                )
                manifest["reason"] = "interrupted (Ctrl-C)"
                write_manifest(stage_dir, manifest)


_STATUS = {
    JobState.PENDING: "pending",
    JobState.RUNNING: "running",
    JobState.SUCCEEDED: "succeeded",
    JobState.FAILED: "failed",
    JobState.CANCELLED: "cancelled",
    JobState.NOT_STARTED: "not_started",
    JobState.UNKNOWN: "unknown",
}


def finalize_stage(pipeline: Pipeline, stage: Stage, manifest: dict, handle: JobHandle) -> None:
    """After a success: the output's hash and size, and the stage's key metrics."""
    output = pipeline.path(stage.output)
    stage_dir = pipeline.path(stage.stage_dir)
    if stage.kind == "generate":
        log = handle.log if handle.log and Path(handle.log).exists() else stage_dir / "stage.log"
        sample = generated_sample(Path(log))
        output.mkdir(parents=True, exist_ok=True)
        (output / SAMPLE_NAME).write_text(sample)
    manifest["output"] = {
        "path": str(stage.output),
        "hash": fingerprint(output),
        "bytes": directory_bytes(output) if output.exists() else None,
    }
    manifest["metrics"] = stage_metrics(stage.kind, stage_dir, output)


def generated_sample(log: Path) -> str:
    """The generated text and speed report from a generate stage's log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    start = next((i for i, line in enumerate(lines) if line.startswith("=== ")), None)
    if start is None:
        return ""
    return "\n".join(lines[start:]).strip() + "\n"


def stage_metrics(kind: str, stage_dir: Path, output: Path) -> dict:
    """Key metrics read from a finished stage's files."""
    metrics: dict[str, Any] = {}
    if kind in TRAINING_KINDS:
        records = read_metrics(stage_dir)
        if records:
            last = records[-1]
            metrics = {k: v for k, v in last.items() if isinstance(v, int | float)}
            metrics.pop("eta_s", None)
            if "loss" in records[0]:
                metrics["first_loss"] = records[0]["loss"]
    elif kind == "eval":
        path = output / "results.json"
        if path.exists():
            data = json.loads(path.read_text())
            metrics = {
                label: entry.get("metrics", {}) for label, entry in data.get("models", {}).items()
            }
    elif kind in ("quantize", "export"):
        metrics["bytes"] = directory_bytes(output) if output.exists() else None
        lineage = output / "lmforge.json"
        if lineage.exists():
            quant = json.loads(lineage.read_text()).get("quantization") or {}
            if quant.get("scheme"):
                metrics["scheme"] = quant["scheme"]
    elif kind == "prepare":
        meta = output / "meta.json"
        if meta.exists():
            data = json.loads(meta.read_text())
            metrics = {k: data[k] for k in ("num_tokens", "num_documents") if k in data}
        elif output.is_dir():  # data files: rows per file
            for file in sorted(output.glob("*.jsonl")):
                metrics[f"{file.stem}_rows"] = sum(1 for line in file.open() if line.strip())
            for file in sorted(output.glob("*.txt")):
                metrics[f"{file.stem}_documents"] = file.read_text().count("\n\n") + 1
    elif kind == "tokenizer":
        if output.exists():
            from lmforge.data.tokenizer import load_tokenizer

            metrics["vocab_size"] = load_tokenizer(output).vocab_size
    elif kind == "generate":
        sample = output / SAMPLE_NAME
        if sample.exists():
            match = re.search(r"tokens/s:\s+([\d.]+) decode", sample.read_text())
            if match:
                metrics["decode_tokens_per_s"] = float(match.group(1))
    return metrics


def _metrics_line(kind: str, metrics: dict) -> str:
    if kind in TRAINING_KINDS and "loss" in metrics:
        first = metrics.get("first_loss")
        start = f"{first:.3f} -> " if isinstance(first, float) else ""
        return f"; loss {start}{metrics['loss']:.3f}"
    return ""


# ----------------------------------------------------------------------------- eval stage


def run_eval_stage(cfg: EvalStageSection) -> dict:
    """Score every model of an eval stage side by side; writes `<cfg.out>/results.json`.

    Metrics per model: `TASK/METRIC` (and `TASK/METRIC_stderr`) for lm-eval tasks, plain
    (`tasks`) and with the chat template (`chat_tasks`); `preference/accuracy` and
    `preference/margin`; `perplexity/FILE`. Returns the results with a printable `table`.
    """
    from lmforge.eval import perplexity, preference_accuracy, run_eval
    from lmforge.eval.harness import metric_rows
    from lmforge.eval.tasks import write_demo_task

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    include = [*cfg.include_path]
    if cfg.demo_data:
        include.append(str(write_demo_task(cfg.demo_data, out / "tasks")))
    limit = None if cfg.limit is None else (int(cfg.limit) if cfg.limit >= 1 else cfg.limit)
    metrics: dict[str, dict[str, float]] = {label: {} for label in cfg.labels}
    samples: dict[str, list] = {}
    for tasks, chat in ((cfg.tasks, False), (cfg.chat_tasks, True)):
        if not tasks:
            continue
        evaluated = run_eval(
            cfg.models,
            tasks,
            include_path=include or None,
            limit=limit,
            batch_size=cfg.batch_size,
            device=cfg.device,
            dtype=cfg.dtype,
            num_fewshot=cfg.num_fewshot,
            apply_chat_template=chat,
            write=False,
        )
        for label, result in zip(cfg.labels, evaluated):
            for (task, metric), (value, stderr) in metric_rows(result.results).items():
                metrics[label][f"{task}/{metric}"] = value
                if stderr is not None:
                    metrics[label][f"{task}/{metric}_stderr"] = stderr
    for label, source in zip(cfg.labels, cfg.models):
        if cfg.answer_data:
            from lmforge.eval.answers import answer_accuracy

            found = answer_accuracy(source, cfg.answer_data, device=cfg.device, dtype=cfg.dtype)
            metrics[label]["answers/exact_match"] = found["exact_match"]
            samples[label] = found["examples"]
        if cfg.preference_data:
            found = preference_accuracy(
                source,
                cfg.preference_data,
                device=cfg.device,
                dtype=cfg.dtype,
                batch_size=cfg.batch_size,
            )
            metrics[label]["preference/accuracy"] = found["accuracy"]
            metrics[label]["preference/margin"] = found["mean_margin"]
        for file in cfg.perplexity:
            found = perplexity(
                source, [file], batch_size=cfg.batch_size, device=cfg.device, dtype=cfg.dtype
            )
            metrics[label][f"perplexity/{Path(file).name}"] = found["perplexity"]
    models = {
        label: {
            "source": source,
            "hash": fingerprint(Path(source)),
            "metrics": metrics[label],
            "answers": samples.get(label, []),
        }
        for label, source in zip(cfg.labels, cfg.models)
    }
    results = {
        "models": models,
        "settings": cfg.model_dump(mode="json"),
        "table": format_eval_table(models),
    }
    tmp = out / ".results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, out / "results.json")
    return results


def format_eval_table(models: Mapping[str, Mapping]) -> str:
    """Models as rows, metrics as columns (value ± stderr where known)."""
    names: list[str] = []
    for entry in models.values():
        for key in entry["metrics"]:
            if not key.endswith("_stderr") and key not in names:
                names.append(key)
    header = ["model", *names]
    rows = []
    for label, entry in models.items():
        row = [label]
        for key in names:
            value = entry["metrics"].get(key)
            stderr = entry["metrics"].get(f"{key}_stderr")
            cell = "-" if value is None else f"{value:.3f}"
            if value is not None and stderr is not None:
                cell += f" ± {stderr:.3f}"
            row.append(cell)
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- status


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
        if gone:
            manifest.update(status="interrupted", reason=gone)
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
        manifest["status"] = _STATUS[handle.state]
        manifest["reason"] = handle.reason
        manifest["ended_at"] = manifest.get("ended_at") or _now()
        if handle.state == JobState.SUCCEEDED:
            try:
                pipeline = load_pipeline(manifest["pipeline_file"], workdir=manifest["workdir"])
                stage = pipeline.stage(manifest["stage"])
                tracker = _Tracker(pipeline, {}, launcher, {}, lambda _: None)
                tracker._record_inputs(stage, manifest)
                finalize_stage(pipeline, stage, manifest, handle)
            except UserError as err:
                manifest["reason"] = f"finished, but its outputs could not be read: {err}"
        write_manifest(stage_dir, manifest)
    elif manifest.get("status") == "pending" and handle.state == JobState.RUNNING:
        manifest["status"] = "running"
        manifest["started_at"] = manifest.get("started_at") or _now()
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


__all__ = [
    "STAGE_KINDS",
    "Pipeline",
    "PipelineFile",
    "PlanItem",
    "RunResult",
    "Stage",
    "StageStatus",
    "fingerprint",
    "format_status",
    "load_pipeline",
    "make_plan",
    "pipeline_status",
    "read_manifest",
    "run_pipeline",
    "stage_job",
]
