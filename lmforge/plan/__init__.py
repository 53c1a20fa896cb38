"""Memory planning: will a training job fit on the GPUs, and what is the smallest setup that does.

`plan_memory(Setup(...), gpu_memory)` does the arithmetic of one training step per GPU, as
lmforge's trainer runs it (memory.py); `dry_run(setup)` applies the real `parallelize()` on the
meta device over a fake process group and checks the sharded sizes against it (dryrun.py);
`plan_job(job, gpus=, gpu_memory=)` plans a pretrain / sft / dpo job config (for
`lmforge run --dry-run`); `search` finds the fewest GPUs that fit; `suggest` ranks changes by
cost. The command is `lmforge plan`.
"""

from lmforge.plan.dryrun import DryRun, dry_run
from lmforge.plan.memory import (
    GPU_MEMORY,
    METHODS,
    Plan,
    Setup,
    Suggestion,
    bytes_per_param,
    check_setup,
    model_state_bytes,
    parse_memory,
    plan_memory,
    setup_from_job,
)
from lmforge.plan.report import format_plan, format_suggestions
from lmforge.plan.search import SearchResult, plan_job, search, suggest

__all__ = [
    "GPU_MEMORY",
    "METHODS",
    "DryRun",
    "Plan",
    "SearchResult",
    "Setup",
    "Suggestion",
    "bytes_per_param",
    "check_setup",
    "dry_run",
    "format_plan",
    "format_suggestions",
    "model_state_bytes",
    "parse_memory",
    "plan_job",
    "plan_memory",
    "search",
    "setup_from_job",
    "suggest",
]
