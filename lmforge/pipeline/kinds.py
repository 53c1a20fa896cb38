"""The registry of stage kinds: what each kind of stage runs and what it produces.

Every stage runs as `lmforge COMMAND --config stage.toml`: the pipeline resolves the stage's
settings (its `${...}` references already replaced) into the config that COMMAND reads, writes
it beside the stage's manifest, and knows nothing else of the command's flags. An entry names
the command, turns the settings into its config (`build`), says where the output goes and which
key metrics to read from a finished stage. Adding a stage kind means giving its command a
`--config FILE` that reads its section, and one entry here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from lmforge.config import Section
from lmforge.errors import ConfigError, StageOrderError
from lmforge.manifest import TRAINING_KINDS, read_metrics
from lmforge.pipeline.references import References, directory_bytes
from lmforge.pipeline.schema import PipelineFile, deep_merge, validate_file, validate_section
from lmforge.quantize.schemes import SCHEMES

SAMPLE_NAME = "sample.txt"  # a generate stage's text and speed report, in its output

Dtype = Literal["float32", "bfloat16", "float16"]


# ----------------------------------------------------------------------------- the commands' configs


class DemoDataSection(Section):
    """`lmforge demo --config`: the demo world's data files (`lmforge.data.demo`); what a
    prepare stage with `demo = {...}` runs."""

    out: str
    seed: int = 0
    num_people: PositiveInt | None = None
    repeats: PositiveInt | None = None


class TokenizerStageSection(Section):
    """`lmforge tokenizer train --config`: a byte-level BPE trained on text files."""

    input: list[str]
    vocab_size: PositiveInt
    min_frequency: PositiveInt = 2
    out: str


class EvalStageSection(Section):
    """`lmforge eval --config`: several models scored side by side (`lmforge.eval.stage`)."""

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
    """Held-out text files: adds `perplexity/FILE` per model."""
    perplexity_seq_len: PositiveInt | None = None
    """Perplexity's window (default: the model's context, at most 2048); a model trained
    on shorter sequences scores its own length best."""
    limit: float | None = None
    batch_size: PositiveInt = 8
    device: str = "auto"
    dtype: Dtype | None = None
    num_fewshot: int | None = None
    out: str
    """Where results.json goes (in a pipeline: the stage's out/)."""

    @model_validator(mode="before")
    @classmethod
    def _default_labels(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and not data.get("labels")
            and isinstance(data.get("models"), list)
        ):
            data = {**data, "labels": [Path(str(m)).name for m in data["models"]]}
        return data

    def problem(self) -> str | None:
        """What makes these settings unusable, in a line; None when they are fine."""
        if not self.models:
            return "name the models to evaluate (models = [...])"
        if len(self.labels) != len(self.models):
            return f"labels has {len(self.labels)} names for {len(self.models)} models"
        if not (
            self.tasks
            or self.chat_tasks
            or self.preference_data
            or self.answer_data
            or self.perplexity
        ):
            return (
                "nothing to evaluate: set tasks, chat_tasks, preference_data, answer_data or "
                "perplexity"
            )
        return None


class QuantizeStageSection(Section):
    """`lmforge quantize --config`: weight-only quantization of a model."""

    source: str
    out: str
    scheme: Literal[SCHEMES]
    group_size: PositiveInt | None = None
    quantize_output: bool = False
    device: str | None = None
    dtype: Dtype | None = None
    format: Literal["torchao", "compressed-tensors"] | None = None
    """None: torchao, or compressed-tensors for method = "gptq"."""
    method: Literal["rtn", "gptq"] = "rtn"
    calibration: str | None = None
    """gptq's samples: a `lmforge prepare` directory or a JSONL file."""
    calibration_samples: PositiveInt = 128
    calibration_seq_len: PositiveInt = 512


class GenerateStageSection(Section):
    """`lmforge generate --config`: texts from a model (greedy, 64 new tokens by default)."""

    artifact: str
    prompt: list[str] = Field(default_factory=list)
    chat: list[str] = Field(default_factory=list)
    raw: bool = False
    """`prompt` text continued as it is, also from a model tuned to chat (`--raw`)."""
    system: str | None = None
    max_new_tokens: PositiveInt = 64
    temperature: float = Field(0.0, ge=0)
    top_k: PositiveInt | None = None
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Dtype | None = None
    lora: str | None = None
    """A PEFT LoRA adapter directory to run with, unmerged (`lmforge generate --lora`)."""


class ExportStageSection(Section):
    """`lmforge export --config`: a training run's newest checkpoint as an artifact."""

    source: str
    out: str
    dtype: Literal["float32", "bfloat16"] = "bfloat16"


# ----------------------------------------------------------------------------- resolving a stage


@dataclasses.dataclass
class StageContext:
    """What a kind's `build` sees of one stage: its settings, its input and its directories."""

    kind: str
    where: str  # "FILE: stage 'NAME'", the prefix of every error
    settings: dict[str, Any]  # the stage table without name/kind/from/launcher, references done
    from_stage: str | None
    outputs: Mapping[str, Path]  # earlier stages' outputs, in file order
    kinds: Mapping[str, str]  # earlier stages' kinds
    all_names: list[str]
    spec: PipelineFile
    refs: References  # records the stages a setting names (dependencies)
    stage_dir: Path
    out_dir: Path
    artifact_dir: Path

    @property
    def from_output(self) -> Path | None:
        return self.outputs.get(self.from_stage) if self.from_stage else None

    def needs_from(self) -> str:
        if self.from_output is None:
            raise ConfigError(
                f"{self.where}: a {self.kind} stage needs from = STAGE (its input model)"
            )
        return str(self.from_output)

    def own(self, *keys: str) -> None:
        """Refuse settings that the pipeline sets itself."""
        for key in keys:
            if key in self.settings:
                raise ConfigError(f"{self.where}: {key!r} is set by the pipeline; remove it")

    def validate(self, schema: type[Section], data: Any) -> Section:
        return validate_section(schema, data, self.where)


@dataclasses.dataclass(frozen=True)
class Built:
    """A stage's command (the words before `--config stage.toml`) and its config."""

    command: tuple[str, ...]
    config: Section


@dataclasses.dataclass(frozen=True)
class StageKind:
    build: Callable[[StageContext], Built]
    output: Literal["artifact", "out"]  # what `${name}` and `from = name` mean: the stage's ...
    finish: Callable[[Path, Path, Path], dict]  # (stage_dir, output, log) -> key metrics
    distributed: bool = False  # runs under torchrun with the stage's nproc_per_node
    one_node: bool = False  # its processes share one node (tensor-parallel inference)
    # (the stage's table) -> why it cannot run on this installation, or None: such a stage is
    # skipped with that line, and so are the stages that need its output
    unavailable: Callable[[Mapping[str, Any]], str | None] | None = None


def _training_schema(kind: str) -> type[Section]:
    from lmforge.train.config import DPOJob, GRPOJob, PretrainJob, SFTJob

    return {"pretrain": PretrainJob, "sft": SFTJob, "dpo": DPOJob, "grpo": GRPOJob}[kind]


def _build_training(ctx: StageContext) -> Built:
    ctx.own("run_dir")
    if ctx.from_output is not None:
        model = {"source": str(ctx.from_output)}
    else:
        pipeline_model = ctx.spec.model.model_dump(mode="json", exclude_none=True)
        model = {
            k: v for k, v in ctx.refs.substitute(pipeline_model).items() if v not in ({}, None)
        }
    data = deep_merge({"model": model}, ctx.settings)
    data["run_dir"] = str(ctx.stage_dir)
    config = validate_file(_training_schema(ctx.kind), data, ctx.where)
    try:
        config.require_data()
    except ConfigError as err:
        raise ConfigError(f"{ctx.where}: {err}") from None
    return Built((ctx.kind,), config)


def _build_prepare(ctx: StageContext) -> Built:
    ctx.own("out")
    if "demo" in ctx.settings:
        demo = ctx.settings["demo"]
        if len(ctx.settings) > 1:
            others = ", ".join(sorted(set(ctx.settings) - {"demo"}))
            raise ConfigError(f"{ctx.where}: demo = {{...}} takes no other settings ({others})")
        data = {**({} if demo is True else demo), "out": str(ctx.out_dir)}
        return Built(("demo",), ctx.validate(DemoDataSection, data))
    from lmforge.data.prepare import PrepareSection

    data = {"workers": 1, **ctx.settings, "out": str(ctx.out_dir)}
    return Built(("prepare",), validate_file(PrepareSection, data, ctx.where))


def _build_tokenizer(ctx: StageContext) -> Built:
    ctx.own("out")
    config = ctx.validate(TokenizerStageSection, {**ctx.settings, "out": str(ctx.out_dir)})
    return Built(("tokenizer", "train"), config)


def _build_eval(ctx: StageContext) -> Built:
    ctx.own("out")
    models = ctx.settings.get("models") or ([ctx.from_stage] if ctx.from_stage else [])
    if not models:
        raise ConfigError(f"{ctx.where}: name the models to evaluate (models = [...] or from)")
    for model in models:
        if model in ctx.all_names and model not in ctx.outputs:
            raise StageOrderError(
                f"{ctx.where}: models: stage {model!r} comes after it in the file (stages run "
                "in file order)",
                stage=model,
            )
    ctx.refs.depends.update(m for m in models if m in ctx.outputs)
    data = {
        **ctx.settings,
        "models": [str(ctx.outputs[m]) if m in ctx.outputs else m for m in models],
        # a stage's name labels its model (its output directory's name would be "artifact")
        "labels": ctx.settings.get("labels") or [Path(m).name for m in models],
        "out": str(ctx.out_dir),
    }
    config = ctx.validate(EvalStageSection, data)
    problem = config.problem()
    if problem:
        raise ConfigError(f"{ctx.where}: {problem}")
    return Built(("eval",), config)


def _build_quantize(ctx: StageContext) -> Built:
    ctx.own("source", "out")
    data = {**ctx.settings, "source": ctx.needs_from(), "out": str(ctx.artifact_dir)}
    return Built(("quantize",), ctx.validate(QuantizeStageSection, data))


def _quantize_unavailable(table: Mapping[str, Any]) -> str | None:
    """GPTQ runs in llm-compressor's own environment, an optional install."""
    if table.get("method") != "gptq":
        return None
    from lmforge.quantize.calibrated import calibration_missing

    return calibration_missing()


def _build_generate(ctx: StageContext) -> Built:
    ctx.own("artifact")
    config = ctx.validate(GenerateStageSection, {**ctx.settings, "artifact": ctx.needs_from()})
    if bool(config.prompt) == bool(config.chat):
        raise ConfigError(f"{ctx.where}: set exactly one of prompt = [...] or chat = [...]")
    return Built(("generate",), config)


def _build_export(ctx: StageContext) -> Built:
    ctx.own("source", "out")
    if ctx.from_stage is None or ctx.kinds.get(ctx.from_stage) not in TRAINING_KINDS:
        raise ConfigError(f"{ctx.where}: an export stage needs from = a training stage")
    # the training run directory (its checkpoints), not the artifact the stage wrote
    source = ctx.stage_dir.parent / ctx.from_stage
    data = {**ctx.settings, "source": str(source), "out": str(ctx.artifact_dir)}
    return Built(("export",), ctx.validate(ExportStageSection, data))


# ----------------------------------------------------------------------------- key metrics


def _training_metrics(stage_dir: Path, output: Path, log: Path) -> dict:
    records = read_metrics(stage_dir)
    if not records:
        return {}
    metrics = {k: v for k, v in records[-1].items() if isinstance(v, int | float)}
    metrics.pop("eta_s", None)
    if "loss" in records[0]:
        metrics["first_loss"] = records[0]["loss"]
    return metrics


def _prepare_metrics(stage_dir: Path, output: Path, log: Path) -> dict:
    meta = output / "meta.json"
    if meta.exists():
        data = json.loads(meta.read_text())
        return {k: data[k] for k in ("num_tokens", "num_documents") if k in data}
    metrics = {}
    if output.is_dir():  # data files: rows per file
        for file in sorted(output.glob("*.jsonl")):
            metrics[f"{file.stem}_rows"] = sum(1 for line in file.open() if line.strip())
        for file in sorted(output.glob("*.txt")):
            metrics[f"{file.stem}_documents"] = file.read_text().count("\n\n") + 1
    return metrics


def _tokenizer_metrics(stage_dir: Path, output: Path, log: Path) -> dict:
    if not output.exists():
        return {}
    from lmforge.data.tokenizer import load_tokenizer

    return {"vocab_size": load_tokenizer(output).vocab_size}


def _eval_metrics(stage_dir: Path, output: Path, log: Path) -> dict:
    path = output / "results.json"
    if not path.exists():
        return {}
    models = json.loads(path.read_text()).get("models", {})
    return {label: entry.get("metrics", {}) for label, entry in models.items()}


def _artifact_metrics(stage_dir: Path, output: Path, log: Path) -> dict:
    metrics: dict[str, Any] = {"bytes": directory_bytes(output) if output.exists() else None}
    lineage = output / "lmforge.json"
    if lineage.exists():
        record = json.loads(lineage.read_text())
        # at the top (compressed-tensors' written before 2026-12-07: in config only)
        quant = record.get("quantization") or record.get("config", {}).get("quantization") or {}
        metrics |= {key: quant[key] for key in ("scheme", "method") if quant.get(key)}
    return metrics


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


def _generate_metrics(stage_dir: Path, output: Path, log: Path) -> dict:
    """Keeps the texts and the speed report of the log as the stage's output (sample.txt)."""
    output.mkdir(parents=True, exist_ok=True)
    sample = generated_sample(log)
    (output / SAMPLE_NAME).write_text(sample)
    match = re.search(r"tokens/s:\s+([\d.]+) decode", sample)
    return {"decode_tokens_per_s": float(match.group(1))} if match else {}


_TRAINING = StageKind(_build_training, "artifact", _training_metrics, distributed=True)

STAGE_KINDS: dict[str, StageKind] = {
    "prepare": StageKind(_build_prepare, "out", _prepare_metrics),
    "tokenizer": StageKind(_build_tokenizer, "out", _tokenizer_metrics),
    "pretrain": _TRAINING,
    "sft": _TRAINING,
    "dpo": _TRAINING,
    "grpo": _TRAINING,
    # tensor parallel over launcher.nproc_per_node GPUs of one node (lmforge/generate/parallel.py)
    "eval": StageKind(_build_eval, "out", _eval_metrics, distributed=True, one_node=True),
    "quantize": StageKind(
        _build_quantize, "artifact", _artifact_metrics, unavailable=_quantize_unavailable
    ),
    "generate": StageKind(
        _build_generate, "out", _generate_metrics, distributed=True, one_node=True
    ),
    "export": StageKind(_build_export, "artifact", _artifact_metrics),
}
assert set(TRAINING_KINDS) <= set(STAGE_KINDS)

__all__ = [
    "STAGE_KINDS",
    "DemoDataSection",
    "EvalStageSection",
    "ExportStageSection",
    "GenerateStageSection",
    "QuantizeStageSection",
    "StageContext",
    "StageKind",
    "TokenizerStageSection",
    "generated_sample",
]
