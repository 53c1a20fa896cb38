"""The pipeline file's schema (`[pipeline]`, `[model]`, `[plan]`, `[data.*]`, `[launcher]`,
`[stages.*]`) and the checks that turn a problem in it into one line naming the file, the stage
and the key."""

from __future__ import annotations

import re
import tempfile
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import tomli_w
from pydantic import Field, field_validator

from lmforge.config import ModelSection, Section, drop_none, load_config
from lmforge.errors import ConfigError
from lmforge.launch.base import SECRET_NAMES

STAGE_CONFIG = "stage.toml"  # a stage's resolved config, beside its manifest


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


def validate_section(schema: type[Section], data: Any, where: str):
    """Validate plain data against a Section; errors as `WHERE: key: problem` lines."""
    try:
        return schema.model_validate(data)
    except pydantic.ValidationError as err:
        lines = []
        for problem in err.errors():
            key = ".".join(str(p) for p in problem["loc"]) or "(top level)"
            if problem["type"] == "extra_forbidden":
                allowed = ", ".join(allowed_keys(schema, problem["loc"][:-1]))
                lines.append(f"{where}: unknown key {key!r}; allowed: {allowed}")
            elif problem["type"] == "missing":
                lines.append(f"{where}: {key} is required")
            else:
                message = problem["msg"].removeprefix("Value error, ")
                message = message.replace("Input should be ", "must be ", 1)
                lines.append(f"{where}: {key} = {problem.get('input')!r}: {message}")
        raise ConfigError("\n".join(lines)) from None


def allowed_keys(schema: type[Section], loc: tuple) -> list[str]:
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


def validate_file(schema: type[Section], data: dict, where: str) -> Section:
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


def refuse_secrets(raw: Any, file: Path, key: str = "") -> None:
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
            refuse_secrets(value, file, dotted)
    elif isinstance(raw, list):
        for item in raw:
            refuse_secrets(item, file, key)


def deep_merge(base: Mapping, override: Mapping) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
