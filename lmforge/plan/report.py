"""Text output of `lmforge plan`: the header, the seed-style bytes/parameter line, the per-GPU
table with its verdict, and the suggestions."""

from __future__ import annotations

import math

from lmforge.plan.memory import (
    COMPONENT_ORDER,
    OPTIMIZER_STATES,
    GiB,
    Plan,
    Setup,
    Suggestion,
    TiB,
    bytes_per_param,
    dtype_name,
    model_state_bytes,
)


def describe(setup: Setup) -> list[str]:
    """Header lines: model, method, layout, precision."""
    a = setup.args
    replicate, shard, tp = setup.mesh
    nodes = setup.num_nodes
    where = f"{setup.gpus} GPU" + ("s" if setup.gpus > 1 else "")
    if nodes > 1:
        where += f" ({nodes} nodes × {math.ceil(setup.gpus / nodes)})"
    method = {
        "pretrain": "pretraining",
        "full": "full finetuning",
        "lora": "LoRA",
        "qlora": "QLoRA (NF4 base)",
        "dpo-lora": "DPO with LoRA",
        "dpo-full": "DPO, full",
    }[setup.method]
    if setup.uses_lora:
        method += f" rank {setup.lora_rank} on {','.join(setup.applied_targets)}"
    if setup.is_dpo:
        method += f" (reference: {setup.reference.replace('_', ' ')})"
    if setup.is_grpo:
        reference = (setup.reference or "none").replace("_", " ")
        method = (
            f"GRPO, {method}: {setup.grpo_prompts} prompts × {setup.grpo_generations} "
            f"completions (KL reference: {reference})"
        )
    if setup.fsdp:
        kind = "HSDP" if replicate > 1 and shard > 1 else "FSDP2"
        layout = f"{kind}: dp_replicate {replicate} × dp_shard {shard} × tp {tp}"
        if setup.ep > 1:
            layout += f", experts split over ep {setup.ep} of the dp_shard ranks"
    elif tp > 1:
        layout = f"tensor parallel {tp} (no FSDP)"
    else:
        one = "bf16 weights, fp32 masters" if setup.master_weights else "autocast"
        layout = f"one GPU, no FSDP ({one})" if setup.gpus == 1 else "no FSDP"
    extras = [f"activation checkpointing {setup.activation_checkpointing}"]
    if setup.cpu_offload:
        extras.append("CPU offload")
    if setup.compile:
        extras.append("compiled")
    batch = f"micro-batch {setup.micro_batch_size} × {setup.seq_len} tokens"
    if setup.is_dpo:
        batch += " (pairs: 2× sequences)"
    if setup.grad_accumulation > 1:
        batch += f", {setup.grad_accumulation} accumulation steps"
    states = OPTIMIZER_STATES[setup.optimizer]
    masters = " + fp32 masters" if setup.master_weights else ""
    precision = (
        f"parameters {setup.weight_dtype}, gradients {setup.grad_dtype or setup.weight_dtype}, "
        f"{setup.optimizer} states {setup.optimizer_dtype or setup.param_dtype} ×{states}"
        f"{masters}, compute {setup.compute_dtype}"
    )
    name = setup.model_name or "model"
    active = a.num_params(active=True)  # a Mixture-of-Experts: fewer than all
    sparse = f", {active / 1e9:.2f}B active a token" if active != a.num_params() else ""
    return [
        f"model      {name}: {a.num_params() / 1e9:.2f}B parameters{sparse} "
        f"({a.num_layers} layers, dim {a.dim}, vocab {a.vocab_size}{', tied' if a.tie_embeddings else ''})",
        f"method     {method}",
        f"GPUs       {where}; {layout}",
        f"step       {batch}; {', '.join(extras)}",
        f"precision  {precision}",
    ]


def state_line(setup: Setup) -> str:
    """The seed's arithmetic for this model: bytes/parameter and the unsharded total."""
    per = bytes_per_param(setup)
    total = model_state_bytes(setup)
    parts = ", ".join(f"{k} {v}" for k, v in per.items())
    if setup.uses_lora:
        return (
            f"model states (unsharded, before activations): trainable {sum(per.values())} "
            f"bytes/parameter ({parts}), frozen base as stored: {total:.3g} bytes = "
            f"{total / TiB:.3f} TiB"
        )
    return (
        f"model states (unsharded, before activations): {sum(per.values())} bytes/parameter "
        f"({parts}) × {setup.args.num_params() / 1e9:.2f}B = {total:.3g} bytes = "
        f"{total / TiB:.2f} TiB"
    )


def format_plan(plan: Plan) -> str:
    s = plan.setup
    lines = describe(s)
    lines.append(state_line(s))
    lines.append("")
    peak = plan.phases[plan.peak_phase]
    labels = {
        "parameters": f"parameters ({_storage_label(s)})",
        "gradients": f"gradients ({s.grad_dtype or s.weight_dtype}"
        + (", fp32 sums)" if s.master_weights and s.grad_accumulation > 1 else ")"),
        "optimizer states": f"optimizer states ({s.optimizer})",
        "reference model": "reference model (frozen copy)",
        "weight copies": plan.labels.get("weight copies", "weight copies"),
        "gradient buffers": plan.labels.get("gradient buffers", "gradient buffers"),
        "activations": f"activations (checkpointing: {s.activation_checkpointing})",
        "logits and loss": f"logits and loss ({_logits_label(s)})",
        "backward workspace": "backward workspace (recompute, activation grads)",
        "rollout replica": "GRPO engine's weight copies (FSDP, TP, fused projections)",
        "KV cache": f"GRPO engine KV cache ({s.rollout_rows} rows × {s.seq_len} slots)",
        "rollout logits": "GRPO decode logits (fp32, every row)",
    }
    width = max(len(v) for v in labels.values()) + 2
    lines.append(f"per GPU, at the peak ({plan.peak_phase})".ljust(width) + "   at peak   largest")
    for name in COMPONENT_ORDER:
        at_peak, largest = peak.get(name, 0), plan.largest(name)
        on_host = s.cpu_offload and name in plan.host
        if largest < 0.005 * GiB and not on_host:  # nothing worth a row (LoRA buffers)
            continue
        extra = f"   on host: {plan.host[name] / GiB:.2f} GiB" if on_host else ""
        lines.append(
            f"  {labels[name]:<{width - 2}} {at_peak / GiB:8.2f} {largest / GiB:9.2f}{extra}"
        )
    lines.append(
        f"  {'CUDA context, NCCL, allocator slack':<{width - 2}} {plan.overhead / GiB:8.2f}"
    )
    lines.append("  " + "-" * (width + 18))
    total = f"  {'total':<{width - 2}} {plan.total / GiB:8.2f} GiB"
    if plan.gpu_memory:
        share = plan.total / plan.gpu_memory
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        total += f" of {plan.gpu_memory / GiB:.1f} GiB  ->  {verdict} ({share:.0%})"
    lines.append(total)
    per_node = min(s.gpus, s.gpus_per_node)
    if plan.host:
        lines.append(
            f"host memory (CPU offload, pinned): {plan.host_total / GiB:.1f} GiB per GPU "
            f"process, {plan.host_total * per_node / GiB:.1f} GiB per node of {per_node}"
        )
    if plan.load_host_bytes:
        lines.append(
            f"host memory while loading: rank 0 holds the full starting weights, "
            f"{plan.load_host_bytes / GiB:.1f} GiB"
        )
    if plan.host_memory is not None and (plan.host or plan.host_fits is False):
        verdict = "fits" if plan.host_fits else "DOES NOT FIT"
        lines.append(
            f"host memory, first node: {plan.host_per_node / GiB:.1f} GiB of "
            f"{plan.host_memory / GiB:.0f} GiB -> {verdict}"
        )
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _storage_label(setup: Setup) -> str:
    label = setup.weight_dtype
    if setup.method == "qlora":
        label = f"NF4 adapted bases, rest {setup.param_dtype}"
    elif setup.uses_lora and setup.frozen_linear_bytes != setup.param_bytes:
        frozen = dtype_name(setup.frozen_linear_bytes)
        label = f"frozen linears {frozen}, rest {setup.weight_dtype}"  # (lora.base_dtype)
    _, shard, _ = setup.mesh
    if setup.fsdp and shard > 1:
        label += f", sharded 1/{shard}"
    return label


def format_suggestions(suggestions: list[Suggestion]) -> str:
    if not suggestions:
        return "suggestions: none of the single changes tried fits (see --search)"
    lines = ["suggestions, cheapest first (cost: relative GPU-hours):"]
    for i, item in enumerate(suggestions, start=1):
        p = item.plan
        lines.append(
            f"  {i}. {item.change:<44} {p.total / GiB:7.1f} GiB  cost ×{item.cost:.2f}"
            + (f"  ({item.note})" if item.note else "")
        )
    return "\n".join(lines)


def _logits_label(s) -> str:
    """How the loss holds its logits (`plan.memory.loss_bytes`), and their shape."""
    vocab = s.args.vocab_size
    if s.is_grpo:  # the completion positions' logits, log-probabilities a chunk at a time
        return f"{s.compute_dtype} [{s.logit_tokens}, {vocab}], fp32 chunks of rows"
    shape = f"[{s.sequences}, {s.seq_len}, {vocab}]"
    if not s.is_dpo and s.tp == 1:
        return f"fused, {s.compute_dtype} {shape}"
    return f"fp32 {shape}"
