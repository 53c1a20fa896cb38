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
    kind = "sft"                       # prepare|tokenizer|pretrain|sft|dpo|grpo|eval|quantize|generate|export
    from = "pretrain"                  # the input artifact: another stage's output
    data.path = "${data.sft_train}"    # the stage's own settings (for training: the job config)
    train.steps = 100
    launcher.nproc_per_node = 2        # resources (lmforge.launch.base.LauncherSection)

Every stage becomes an lmforge command line, `lmforge COMMAND --config <stage_dir>/stage.toml`
(`StageJob`: e.g. `lmforge sft --config runs/tiny/sft/stage.toml`), with its resolved config
written beside it, so any launcher (local, Slurm, Kubernetes) can run it. Each stage directory holds `manifest.json`: the resolved config and
its hash, the input artifacts and their hashes, the code version, the status (pending, running,
succeeded, failed, not_started, cancelled, skipped), timings, key metrics and the output artifact
with its hash. Like `make`, a stage whose config and inputs equal those of its last success (and
whose output is still there) is skipped; a stage that runs makes every stage downstream of it run.

Secrets (HF_TOKEN, WANDB_API_KEY, LMFORGE_API_KEY) come from the environment or a secrets file
and reach the jobs through their environment only (lmforge.launch.base); they are refused in
the pipeline file and never written to manifests, configs or scripts.

By job: schema.py (the file's sections and their checks), kinds.py (the registry of stage kinds:
each one's command, config and key metrics), references.py (`${...}` references, input
fingerprints), spec.py (`load_pipeline`: the file resolved into `Stage`s), planning.py (what runs,
what is up to date, memory plans), manifest.py (writing the stage manifests), runner.py
(`run_pipeline`), status.py (`lmforge status`). Reading manifests is lmforge.manifest's.
"""

from lmforge.manifest import read_manifest, write_manifest
from lmforge.pipeline.kinds import STAGE_KINDS
from lmforge.pipeline.planning import PlanItem, make_plan
from lmforge.pipeline.references import fingerprint
from lmforge.pipeline.runner import RunResult, run_pipeline, stage_job
from lmforge.pipeline.schema import PipelineFile
from lmforge.pipeline.spec import Pipeline, Stage, load_pipeline
from lmforge.pipeline.status import (
    StageStatus,
    format_status,
    latest_run_dir,
    pipeline_status,
)

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
    "latest_run_dir",
    "load_pipeline",
    "make_plan",
    "pipeline_status",
    "read_manifest",
    "run_pipeline",
    "stage_job",
    "write_manifest",
]
