"""Memory plans of a pipeline's stages, for `lmforge run` (dry or not): the planner's arithmetic
(lmforge/plan/) applied to stages as the pipeline spec describes them, so it lives above both.

Each pretrain / sft / dpo stage that is about to run is planned as it will be launched: its job
config on `nodes × nproc_per_node` GPUs of `[plan] gpu_memory`. Each eval, generate and quantize
stage is planned with the inference planner (lmforge/plan/inference.py): its model's weights on
`nproc_per_node` GPUs (tensor parallel), the KV cache and activations of its batch, or one tensor
at a time for streaming quantization. A stage whose input model is not
on disk yet (the output of an upstream stage, or a download still to come) is planned with the
shape it will have: the upstream stage's model, back to the pipeline's `[model]`, or
`[plan] model` when even that is not there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.errors import UserError
from lmforge.pipeline.spec import Pipeline, Stage
from lmforge.plan.inference import (
    EVAL_SCORED_TOKENS,
    InferencePlan,
    InferenceSetup,
    format_inference_plan,
    plan_inference,
    suggest_inference,
)
from lmforge.plan.memory import GiB, Plan, parse_memory
from lmforge.plan.search import plan_job
from lmforge.quantize.stored import has_mxfp4_experts

if TYPE_CHECKING:
    from lmforge.models import ModelArgs

PLAN_FILE = "memory_plan.txt"  # the table, in the stage's directory
INFERENCE_KINDS = ("eval", "generate", "quantize")
EVAL_CONTEXT = 4096  # tokens per row an eval stage is planned with (the engine's default cache)


@dataclasses.dataclass
class StagePlan:
    stage: Stage
    plan: Plan | InferencePlan | None  # None: not planned (see `skipped`)
    skipped: str = ""  # why it was not planned
    error: bool = False  # `skipped` says why the stage will fail as configured

    def summary(self) -> str:
        head = f"  {self.stage.name:<14} {self.stage.kind:<9}"
        if self.plan is None:
            return f"{head} {'WILL FAIL' if self.error else 'not planned'}: {self.skipped}"
        p = self.plan
        gpus = p.gpus if isinstance(p, InferencePlan) else p.setup.gpus
        verdict = "fits" if p.fits else "DOES NOT FIT"
        line = (
            f"{head} {gpus} GPU{'s' if gpus > 1 else ''}: {p.total / GiB:.1f} GiB of "
            f"{p.gpu_memory / GiB:.1f} GiB per GPU, {verdict} ({p.total / p.gpu_memory:.0%})"
        )
        if isinstance(p, InferencePlan):
            return line + f" [{_what(p)}]"
        if p.setup.cpu_offload or p.host_fits is False:
            line += f"; host {p.host_per_node / GiB:.0f} GiB per node"
        return line

    def table(self) -> str:
        if isinstance(self.plan, InferencePlan):
            return format_inference_plan(self.plan)
        from lmforge.plan.report import format_plan

        return format_plan(self.plan)


def _what(plan: InferencePlan) -> str:
    s = plan.setup
    weights = s.quantization or s.dtype
    if s.task == "quantize":
        return f"GPTQ on the host, {s.batch} samples" if s.calibrated else "one tensor at a time"
    if s.task in ("score", "eval"):
        return f"{weights}, {s.batch} rows × {s.seq_len} tokens"
    return f"{weights}, KV cache {s.batch} × {s.seq_len}"


def plan_stages(pipeline: Pipeline, stages: list[Stage], launcher: str) -> list[StagePlan]:
    """A StagePlan for each training and inference stage in `stages`, as `launcher` would run
    it."""
    from lmforge.manifest import TRAINING_KINDS

    section = pipeline.plan_section
    plans = []
    for stage in stages:
        if stage.kind in INFERENCE_KINDS:
            plans.append(plan_inference_stage(pipeline, stage, launcher))
            continue
        if stage.kind not in TRAINING_KINDS:
            continue
        gpu_memory = _gpu_memory(section.gpu_memory, stage.config.train.device, launcher, stage)
        if isinstance(gpu_memory, str):
            plans.append(StagePlan(stage, None, gpu_memory))
            continue
        resources = stage.resources
        try:
            args = source_args(pipeline, stage, section.model)
        except UserError as err:
            plans.append(StagePlan(stage, None, str(err)))
            continue
        plan = plan_job(
            stage.config,
            gpus=resources.nodes * resources.nproc_per_node,
            gpus_per_node=resources.nproc_per_node,
            gpu_memory=gpu_memory,
            host_memory=section.host_memory,
            args=args,
        )
        plans.append(StagePlan(stage, plan))
    return plans


def plan_inference_stage(pipeline: Pipeline, stage: Stage, launcher: str) -> StagePlan:
    """The plan of an eval, generate or quantize stage on `launcher.nproc_per_node` GPUs
    (tensor parallel; quantize runs on one): an eval stage's largest model, scoring and
    generating; suggestions when it does not fit."""
    config = stage.config
    section = pipeline.plan_section
    device = getattr(config, "device", None)
    gpu_memory = _gpu_memory(section.gpu_memory, device, launcher, stage)
    if isinstance(gpu_memory, str):
        return StagePlan(stage, None, gpu_memory)
    tp = stage.resources.nproc_per_node * stage.resources.nodes if stage.distributed else 1
    try:
        setups = _inference_setups(pipeline, stage, tp)
    except UserError as err:  # a model not on disk yet, without [plan] model
        return StagePlan(stage, None, str(err))
    try:
        plans = [plan_inference(setup, gpu_memory) for setup in setups]
    except UserError as err:  # what the engine or the TP loader refuses
        return StagePlan(stage, None, str(err), error=True)
    plan = max(plans, key=lambda p: p.total)
    if stage.kind == "eval":
        plan.notes.append(
            f"rows of at most {EVAL_CONTEXT} tokens assumed (lm-eval's multiple-choice requests "
            "are shorter; longer requests need more)"
        )
    elif stage.kind == "generate":
        plan.notes.append(
            "prompt lengths estimated from their characters (at most one token per character)"
        )
    if not plan.fits:
        plan.suggestions = suggest_inference(
            plan.setup,
            gpu_memory,
            max_gpus=stage.resources.gpus_per_node or 8,
            command=stage.kind,
            batch_name="batch_size" if stage.kind == "eval" else "prompts at once",
        )
    return StagePlan(stage, plan)


def _inference_setups(pipeline: Pipeline, stage: Stage, tp: int) -> list[InferenceSetup]:
    """What an inference stage runs, as InferenceSetups (one per model and kind of work)."""
    config = stage.config
    fallback = pipeline.plan_section.model
    dtype = {"float32": "fp32", "float16": "fp16"}.get(getattr(config, "dtype", None), "bf16")
    if stage.kind == "quantize":
        args = source_args(pipeline, stage, fallback)
        if config.method == "gptq":  # samples x tokens through the model, on the host
            return [InferenceSetup(args=args, task="quantize", dtype=dtype, calibrated=True,
                                   batch=config.calibration_samples,
                                   seq_len=config.calibration_seq_len)]  # fmt: skip
        return [InferenceSetup(args=args, task="quantize", dtype=dtype)]
    if stage.kind == "generate":
        args = source_args(pipeline, stage, fallback)
        prompts = config.prompt or config.chat
        # a token is at least a character; a chat template adds a few dozen tokens
        longest = max(len(p) for p in prompts) + (64 if config.chat else 0)
        return [
            InferenceSetup(
                args=args,
                tp=tp,
                dtype=dtype,
                batch=min(8, len(prompts)),  # `lmforge generate --max-batch`'s default
                seq_len=min(args.max_seq_len, longest + config.max_new_tokens),
                **_quantization(pipeline, config.artifact),
            )
        ]
    setups = []
    for model in config.models:
        upstream = _stage_of_output(pipeline, model)
        if upstream is not None:
            args = source_args(pipeline, upstream, fallback)
        else:
            args = source_args_of_path(pipeline, model, fallback)
        base = InferenceSetup(
            args=args,
            tp=tp,
            dtype=dtype,
            batch=config.batch_size,
            seq_len=min(args.max_seq_len, EVAL_CONTEXT),
            **_quantization(pipeline, model),
        )
        scored = None if config.perplexity else min(EVAL_SCORED_TOKENS, base.seq_len)
        setups.append(base.replace(task="eval", scored_tokens=scored))
    return setups


def _stage_of_output(pipeline: Pipeline, path: str) -> Stage | None:
    return next((s for s in pipeline.stages if str(s.output) == str(path)), None)


def source_args_of_path(pipeline: Pipeline, path: str, fallback: str | None) -> ModelArgs:
    """The shape of a model named by its path (not a stage): read from disk or the fallback."""
    from lmforge import api
    from lmforge.models import PRESETS

    if path in PRESETS or pipeline.path(Path(path)).exists():
        return api.read_args(path if path in PRESETS else pipeline.path(Path(path)))
    if fallback is not None:
        return api.read_args(fallback if fallback in PRESETS else pipeline.path(Path(fallback)))
    raise UserError(f"the model {path} is not on disk; set [plan] model to plan with its shape")


def _quantization(pipeline: Pipeline, path: str) -> dict:
    """InferenceSetup's quantization settings of the model at `path`: those of the quantize
    stage that makes it, or those its lmforge.json records."""
    upstream = _stage_of_output(pipeline, path)
    if upstream is not None and upstream.kind == "quantize":
        c = upstream.config
        return {
            "quantization": c.scheme,
            "group_size": c.group_size,
            "quantize_output": c.quantize_output,
            "int4_packed": c.device != "cpu",  # made on CUDA: tinygemm's layout
        }
    lineage = pipeline.path(Path(path)) / "lmforge.json"
    if upstream is None and has_mxfp4_experts(pipeline.path(Path(path))):
        return {"mxfp4_experts": True}
    if upstream is not None or not lineage.exists():
        return {}
    import json

    quant = json.loads(lineage.read_text()).get("quantization") or {}
    if not quant.get("scheme"):
        return {}
    return {
        "quantization": quant["scheme"],
        "group_size": quant.get("group_size"),
        "quantize_output": bool(quant.get("quantize_output")),
        "int4_packed": quant.get("tensor_type") == "Int4TilePackedTo4dTensor",
    }


def _gpu_memory(
    configured: str | None, device: str | None, launcher: str, stage: Stage
) -> int | str:
    """Bytes per GPU, or why the stage is not planned."""
    import torch

    if device in ("auto", None):  # as the job will resolve it where it runs
        on_gpu = torch.cuda.is_available() if launcher == "local" else stage.resources.gpus_per_node
        device = "cuda" if on_gpu else "cpu"
    if device == "cpu":
        return "runs on the CPU"
    if configured is not None:
        return parse_memory(configured)
    if launcher == "local" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return "set [plan] gpu_memory (e.g. 80GB, h200) to check that it fits"


def source_args(pipeline: Pipeline, stage: Stage, fallback: str | None = None) -> ModelArgs:
    """The shape of the model `stage` starts from, read from disk when it is there, else from
    the stage that will make it, else from `fallback` (a preset or a config directory)."""
    from lmforge import api, hub
    from lmforge.errors import HubError
    from lmforge.models import PRESETS

    model = getattr(stage.config, "model", None)
    source = getattr(model, "source", None)
    if source is not None and source in PRESETS:
        return api.read_args(source)
    if source is not None and pipeline.path(Path(source)).exists():
        return api.read_args(pipeline.path(Path(source)))
    repo_id = source is not None and hub.is_repo_id(source)
    if repo_id and (fallback is None or hub.is_cached(source, weights=False)):
        try:
            return api.read_args(source)  # fetches the hub model's config.json only
        except HubError:
            pass  # not a hub model after all (or no hub here): a download still to come
    if stage.from_stage is not None:
        upstream = pipeline.stage(stage.from_stage)
        args = source_args(pipeline, upstream, fallback)
        overrides = getattr(getattr(upstream.config, "model", None), "overrides", None)
        return args.replace(**overrides) if overrides else args
    if fallback is not None:
        return api.read_args(fallback if fallback in PRESETS else pipeline.path(Path(fallback)))
    raise UserError(
        f"the model {source} is not on disk yet; set [plan] model = PRESET (e.g. llama3.1-70b) "
        "or a config directory to plan with its shape"
    )


def format_stage_plans(plans: list[StagePlan]) -> list[str]:
    """Console lines: one summary per stage, then a warning for each that does not fit."""
    from lmforge.plan.report import format_suggestions

    lines = ["memory plan (lmforge plan) of the stages, per GPU as launched:"]
    lines += [p.summary() for p in plans]
    for item in plans:
        if item.error:
            lines.append(f"WARNING: stage {item.stage.name!r} will fail: {item.skipped}")
        if isinstance(item.plan, InferencePlan) and not item.plan.fits:
            lines.append(
                f"WARNING: stage {item.stage.name!r} will not fit: "
                f"{item.plan.total / GiB:.1f} GiB needed per GPU of "
                f"{item.plan.gpu_memory / GiB:.1f} GiB (the table: "
                f"{item.stage.stage_dir / PLAN_FILE}); "
                + (
                    "it fits with one of: " + "; ".join(item.plan.suggestions)
                    if item.plan.suggestions
                    else "no single change tried fits"
                )
            )
        elif item.plan is not None and not item.plan.fits:
            lines.append(
                f"WARNING: stage {item.stage.name!r} will not fit: "
                f"{item.plan.total / GiB:.1f} GiB needed per GPU of "
                f"{item.plan.gpu_memory / GiB:.1f} GiB (the table: "
                f"{item.stage.stage_dir / PLAN_FILE}); as `lmforge plan` flags, "
                + format_suggestions(item.plan.suggestions)
            )
    return lines
