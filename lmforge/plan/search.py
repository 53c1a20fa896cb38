"""Searching setups: the fewest GPUs that fit (`search`), and single changes that make a plan
fit, ranked by what they cost in GPU-hours (`suggest`), and the plan of a training job config
with its suggestions (`plan_job`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmforge.errors import ConfigError
from lmforge.plan.memory import (
    AC_MODES,
    HOST_MEMORY_PER_GPU,
    Plan,
    Setup,
    Suggestion,
    check_setup,
    parse_memory,
    plan_memory,
    setup_from_job,
)

# Rough step-time multipliers used to rank suggestions (one extra forward for full
# checkpointing; half the matmuls again for selective; PCIe traffic for CPU offload).
SLOWDOWN = {"ac:selective": 1.12, "ac:full": 1.33, "offload": 2.0, "tp": 1.05}


def _slowdown(setup: Setup) -> float:
    factor = 1.0
    if setup.activation_checkpointing != "none":
        factor *= SLOWDOWN[f"ac:{setup.activation_checkpointing}"]
    if setup.cpu_offload:
        factor *= SLOWDOWN["offload"]
    if setup.mesh[2] > 1:
        factor *= SLOWDOWN["tp"] ** math.log2(setup.mesh[2])
    return factor


def _layouts(base: Setup, gpus: int, fixed: set[str]) -> list[Setup]:
    """Candidate setups on `gpus` GPUs: tp ∈ {1, 2, 4, 8} (within a node), plain FSDP or HSDP
    over nodes, each activation checkpointing mode, with and without CPU offload."""
    a = base.args
    per_node = min(gpus, base.gpus_per_node)
    nodes = math.ceil(gpus / base.gpus_per_node)
    tps = [base.tp] if "tp" in fixed else [t for t in (1, 2, 4, 8) if t <= per_node]
    acs = [base.activation_checkpointing] if "ac" in fixed else list(AC_MODES)
    offloads = [base.cpu_offload] if "cpu_offload" in fixed else [False, True]
    replicates = [base.dp_replicate] if "dp_replicate" in fixed else sorted({1, nodes})
    out = []
    for tp in tps:
        if gpus % tp or (tp > 1 and (a.num_kv_heads % tp or base.uses_lora)):
            continue
        for replicate in replicates:
            if gpus % (replicate * tp):
                continue
            for ac in acs:
                for offload in offloads:
                    candidate = base.replace(
                        gpus=gpus,
                        tp=tp,
                        dp_replicate=replicate,
                        dp_shard=-1,
                        activation_checkpointing=ac,
                        cpu_offload=offload,
                    )
                    try:
                        check_setup(candidate)
                    except ConfigError:
                        continue
                    out.append(candidate)
    return out


def gpu_counts(gpus_per_node: int, limit: int = 4096) -> list[int]:
    """1, 2, 4, ... up to a node, then whole nodes."""
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n < min(gpus_per_node, limit)]
    if gpus_per_node <= limit:
        counts.append(gpus_per_node)
    nodes = 2
    while nodes * gpus_per_node <= limit:
        counts.append(nodes * gpus_per_node)
        nodes += 1 if nodes < 8 else nodes // 4
    return counts


@dataclass
class SearchResult:
    gpus: int
    plan: Plan | None  # the cheapest fitting setup at that count; None: nothing fits
    tried: int


def search(
    base: Setup,
    gpu_memory: int,
    *,
    host_memory: int | None = None,
    fixed: set[str] = frozenset(),
    limit: int = 4096,
) -> SearchResult:
    """The fewest GPUs of `gpu_memory` on which `base` (method, model, batch fixed) fits, and
    the cheapest degrees / checkpointing / offload there (by `_slowdown`). Keys in `fixed`
    (tp, ac, cpu_offload, dp_replicate) keep base's value. host_memory: per node (None: the
    default per GPU)."""
    tried = 0
    counts = gpu_counts(base.gpus_per_node, limit)
    for gpus in counts:
        best = None
        for candidate in _layouts(base, gpus, set(fixed)):
            tried += 1
            plan = plan_memory(candidate, gpu_memory, host_memory=host_memory)
            if plan.fits and (best is None or _slowdown(candidate) < _slowdown(best.setup)):
                best = plan
        if best is not None:
            return SearchResult(gpus=gpus, plan=best, tried=tried)
    return SearchResult(gpus=counts[-1], plan=None, tried=tried)


def suggest(plan: Plan, *, max_items: int = 6) -> list[Suggestion]:
    """Single changes that make `plan` fit (or fit better), cheapest first: cost = the step
    time multiplier × the GPU-count ratio (GPU-hours), LoRA/QLoRA flagged as changing the
    method."""
    s = plan.setup
    if plan.gpu_memory is None:
        return []
    out: list[Suggestion] = []
    # A host size the user gave is per node; the default grows with the GPUs of a node.
    host = (
        None
        if plan.host_memory == HOST_MEMORY_PER_GPU * min(s.gpus, s.gpus_per_node)
        else plan.host_memory
    )

    def consider(change: str, candidate: Setup, note: str = "") -> None:
        try:
            p = plan_memory(candidate, plan.gpu_memory, host_memory=host)
        except ConfigError:
            return
        if p.fits:
            cost = _slowdown(candidate) / _slowdown(s) * candidate.gpus / s.gpus
            out.append(Suggestion(change=change, plan=p, cost=cost, note=note))

    order = list(AC_MODES)
    for mode in order[order.index(s.activation_checkpointing) + 1 :]:
        consider(f"--ac {mode}", s.replace(activation_checkpointing=mode))
    mbs = s.micro_batch_size
    while mbs > 1:
        mbs //= 2
        accumulation = s.grad_accumulation * math.ceil(s.micro_batch_size / mbs)
        candidate = s.replace(micro_batch_size=mbs, grad_accumulation=accumulation)
        before = len(out)
        consider(
            f"--micro-batch-size {mbs}",
            candidate,
            note=f"same global batch with {accumulation} gradient accumulation steps",
        )
        if len(out) > before:
            out[-1].cost *= 1.05  # smaller matmuls run a little less efficiently
            break
    rows = s.rollout_rows if s.is_grpo else 1
    while rows > 1:  # GRPO: fewer KV-cache rows (continuous batching over the sequences)
        rows //= 2
        before = len(out)
        consider(
            f"--rollout-batch {rows}",
            s.replace(grpo_rollout_batch=rows),
            note="grpo.rollout_batch: the engine's KV cache holds fewer sequences at once",
        )
        if len(out) > before:
            out[-1].cost *= 1.1  # the rollouts decode fewer rows a step
            break
    if not s.cpu_offload and s.method != "qlora":
        consider("--cpu-offload", s.replace(cpu_offload=True))
    if s.method != "qlora":
        result = search(
            s, plan.gpu_memory, host_memory=host, fixed={"ac", "cpu_offload", "tp", "dp_replicate"}
        )
        if result.plan is not None and result.gpus != s.gpus:
            consider(f"--gpus {result.gpus}", result.plan.setup)
        result = search(s, plan.gpu_memory, host_memory=host)
        if result.plan is not None and (result.gpus, result.plan.setup) != (s.gpus, s):
            p = result.plan.setup
            change = f"--gpus {p.gpus} --tp {p.mesh[2]} --ac {p.activation_checkpointing}"
            change += " --cpu-offload" if p.cpu_offload else ""
            if all(x.change != change for x in out):
                consider(change, p, note="fewest GPUs (--search)")
    if s.method in ("full", "dpo-full"):
        method = "lora" if s.method == "full" else "dpo-lora"
        consider(
            f"--method {method}",
            s.replace(method=method, tp=1, dp_shard=-1),
            note="changes the method: LoRA adapters instead of full finetuning",
        )
    if s.method in ("lora", "full") and not s.cpu_offload and s.mesh[2] == 1:
        consider(
            "--method qlora",
            s.replace(method="qlora"),
            note="changes the method: NF4 frozen base",
        )
    unique: dict[str, Suggestion] = {}
    for item in sorted(out, key=lambda x: (x.cost, x.plan.total)):
        unique.setdefault(item.change, item)
    return list(unique.values())[:max_items]


# parallel.reshard_after_forward = "auto" keeps the gathered weights when the planner puts the
# job within this share of the device's memory (the rest: fragmentation and the planner's error).
AUTO_KEEP_GATHERED_MEMORY_FRACTION = 0.85


def resolve_reshard_after_forward(setup, device_memory: int | None) -> bool:
    """parallel.reshard_after_forward for the planner's `setup` (lmforge.plan.Setup of the job).

    true / false as set. "auto": false (each block's gathered weights kept from forward to
    backward: one all-gather per block and step instead of two) when the planner predicts that
    the job still fits in AUTO_KEEP_GATHERED_MEMORY_FRACTION of `device_memory` (bytes) that
    way, else true; true without a device memory (the CPU) or without FSDP.
    """
    if setup.reshard_after_forward != "auto":
        return bool(setup.reshard_after_forward)
    if device_memory is None or not setup.fsdp:
        return True
    budget = int(AUTO_KEEP_GATHERED_MEMORY_FRACTION * device_memory)
    kept = plan_memory(setup.replace(reshard_after_forward=False), budget)
    return not kept.gpu_fits


@dataclass(frozen=True)
class ReshardByPlan:
    """`lmforge.train.stage.ReshardPolicy` by the planner: "auto" resolved for a training job
    config on `world_size` GPUs of `device_memory` bytes (`resolve_reshard_after_forward`)."""

    @property
    def keep_fraction(self) -> float:
        return AUTO_KEEP_GATHERED_MEMORY_FRACTION

    def __call__(self, job, args, world_size: int, device_memory: int | None) -> bool:
        setup = setup_from_job(job, gpus=world_size, args=args)
        return resolve_reshard_after_forward(setup, device_memory)


def plan_job(
    job,
    *,
    gpus: int,
    gpu_memory: int | str,
    gpus_per_node: int = 8,
    host_memory: int | str | None = None,
    args=None,
) -> Plan:
    """Plan a training stage's job config on `gpus` GPUs of `gpu_memory` (bytes, or '80GB',
    'h100', ...), with suggestions when it does not fit (`args`: see `setup_from_job`). For
    `lmforge run` (lmforge.pipeline.stage_plans)."""
    setup = setup_from_job(job, gpus=gpus, gpus_per_node=gpus_per_node, args=args)
    gpu_memory = parse_memory(gpu_memory)
    # parallel.reshard_after_forward = "auto" decided as the trainer decides it on this GPU.
    setup = setup.replace(reshard_after_forward=resolve_reshard_after_forward(setup, gpu_memory))
    plan = plan_memory(setup, gpu_memory, host_memory=host_memory)
    if not plan.fits:
        plan.suggestions = suggest(plan)
    return plan
