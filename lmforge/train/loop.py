"""The one training loop, shared by pretraining, SFT and DPO.

A method plugs in only its batches and its `loss_step(model, batch) -> LossOutput`. Written once
here: gradient accumulation normalized by the step's target tokens over all micro-batches and
ranks, mixed precision, clipping, the NaN/Inf stop, the lr schedule, metrics, profiling,
checkpoints with automatic resume, preemption and artifact export.

Mixture-of-Experts models (any model with an `aux_loss()`, asked by name, never by family) get
their load-balancing loss added to every method's loss. A micro-batch's backward takes
loss_sum · dp_size / step_targets + aux_loss / accumulation_steps: with one micro-batch on one
rank that is transformers' `Qwen3MoeForCausalLM` loss (mean cross entropy + router_aux_loss_coef
× load balancing) exactly. With accumulation or data parallelism the first term is still the
whole step's token mean, the second the mean over the step's micro-batches (and ranks, FSDP
averaging) of each micro-batch's own auxiliary loss, as transformers gives for each forward:
not the loss of the pooled batch (f · P is not linear in the tokens), so runs that split a
step's sequences differently between micro-batches differ by that term. Padding positions of
right-padded rows (SFT, DPO, GRPO) are routed and counted like the others (the batches carry no
attention mask; transformers given one leaves them out). The logged `loss` is the
method's own (comparable with a dense model's); `aux_loss` is logged beside it, and the
experts' load (`expert_counts()`) per sparse layer: `expert_load_min/L`, `expert_load_max/L`
(fractions of the layer's top-k choices), `expert_load_max_mean/L` (max over mean: 1 when
balanced, E / k when every token picks the same k) and, over layers, the worst
`expert_load_max_mean`. After each update the model's `update_expert_bias` gets the step's
counts (all ranks and micro-batches summed): DeepSeek-V3's auxiliary-loss-free balancing, on
when the model's `router_bias_update` is.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.errors import ConfigError, UserError
from lmforge.parallel.distributed import Layout
from lmforge.train.config import CheckpointSection, MetricsSection, ProfileSection, TrainSection
from lmforge.train.losses import LossOutput, count_label_tokens
from lmforge.train.metrics import MetricsLogger, Throughput, peak_memory_gb
from lmforge.train.preempt import PreemptedError, active_watch
from lmforge.train.profiling import Profiler

log = logging.getLogger(__name__)

LossStep = Callable[[torch.nn.Module, dict], LossOutput]


class TrainingDivergedError(UserError):
    """NaN/Inf loss or gradient norm; the last good checkpoint is kept."""

    exit_code = 3


@dataclass
class LoopSections:
    train: TrainSection
    checkpoint: CheckpointSection
    metrics: MetricsSection
    profile: ProfileSection


def grad_accumulation_steps(cfg: TrainSection, dp_size: int) -> int:
    """Micro-batches per optimizer step, from global = micro × accumulation × dp."""
    per_pass = cfg.micro_batch_size * dp_size
    if cfg.global_batch_size is None:
        return 1
    if cfg.global_batch_size % per_pass:
        raise UserError(
            f"train.global_batch_size ({cfg.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size ({cfg.micro_batch_size}) × data-parallel size ({dp_size}) "
            f"= {per_pass}"
        )
    return cfg.global_batch_size // per_pass


def skips_diverged_step_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether `optimizer` can be launched before the step's host sync: fused Adam/AdamW skip
    the whole update on the device when handed `found_inf` = 1. Other optimizers, and parameters
    off the compute device (FSDP2 CPU offload), wait for the host's finiteness check."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return False
    groups = optimizer.param_groups
    return all(group["fused"] for group in groups) and all(
        param.device.type == device.type for group in groups for param in group["params"]
    )


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients' 2-norm. bf16 gradients (of bf16 weights with fp32 masters) sum their
    squares in fp32: torch's norm of bf16 tensors is a bf16 number, three digits in the logs."""
    if grads and all(g.dtype == torch.bfloat16 and not isinstance(g, DTensor) for g in grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, torch.float32)))
    groups = by_mesh(grads)
    if len(groups) > 1:
        # DTensors on several meshes (expert parallelism: the experts' and the rest): each
        # mesh's norm on its own, reduced to a plain number, then the norm of those.
        norms = [total_grad_norm(group) for group in groups]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return torch.nn.utils.get_total_norm(grads, foreach=True)


def by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by their DTensor mesh (plain tensors together), in first-seen order:
    foreach ops take one mesh per list, and expert parallelism puts the experts on their own."""
    groups: dict[object, list[torch.Tensor]] = {}
    for tensor in tensors:
        mesh = tensor.device_mesh if isinstance(tensor, DTensor) else None
        groups.setdefault(mesh, []).append(tensor)
    return list(groups.values())


def clip_grads(params: list[torch.Tensor], max_norm: float, grad_norm: torch.Tensor) -> None:
    """Scale the gradients by min(1, max_norm / grad_norm), one foreach pass per mesh."""
    for group in by_mesh(p for p in params if p.grad is not None):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, grad_norm, foreach=True)


def add_in_fp32(params: list[torch.Tensor], sums: dict, *, last: bool) -> None:
    """After a micro-batch's backward: each bf16 gradient is added into its fp32 sum in `sums`
    and dropped; after the last, the sum is rounded into the gradient once (as one micro-batch's
    gradient is), so the micro-batches of a step do not add up in bf16."""
    for param in params:
        if param.grad is not None:
            if param in sums:
                sums[param].add_(param.grad)
            else:
                sums[param] = param.grad.float()
            param.grad = None
        if last and param in sums:
            param.grad = sums.pop(param).to(param.dtype)


class Trainer:
    def __init__(
        self,
        *,
        model: torch.nn.Module,
        loss_step: LossStep,
        batches: Iterator[dict],
        optimizer: torch.optim.Optimizer,
        scheduler,
        layout: Layout,
        sections: LoopSections,
        run_dir: Path,
        checkpointer,
        checkpoint_state: dict,
        flops_per_token: float,
        bf16: bool,
        export: Callable[[int, bool], None] | None = None,
        job_config: dict | None = None,
        count_targets: Callable[[dict], torch.Tensor] = count_label_tokens,
        heldout: Callable[[], Iterable[dict]] | None = None,
        batch_metrics: Callable[[int], dict[str, float]] | None = None,
    ) -> None:
        self.model, self.loss_step, self.batches = model, loss_step, batches
        self.optimizer, self.scheduler = optimizer, scheduler
        self.layout, self.cfg, self.run_dir = layout, sections, run_dir
        self.checkpointer, self.checkpoint_state = checkpointer, checkpoint_state
        self.export = export
        self.accum_steps = grad_accumulation_steps(sections.train, layout.dp_size)
        self.is_fsdp = hasattr(model, "set_requires_gradient_sync")
        # FSDP2's mixed-precision policy casts for us; a single device uses autocast (a no-op
        # for bf16 weights with fp32 masters in the optimizer, lmforge.train.adamw, but not for
        # fp32 modules beside them: DPO's frozen reference).
        self.autocast = bf16 and not self.is_fsdp
        self.step = 0
        self.tokens_seen = 0
        self.flops_per_token = flops_per_token
        self.job_config = job_config
        self.count_targets = count_targets
        self.heldout = heldout  # () -> one pass over the held-out batches (this rank's)
        # (step) -> what the batch source measured for the step just taken (GRPO's rollouts:
        # rewards, timings, held-out rewards), this rank's values, logged as they are
        self.batch_metrics = batch_metrics
        self.params = [p for p in model.parameters() if p.requires_grad]
        # bf16 weights (fp32 masters in the optimizer) sum their micro-batches' gradients in fp32
        self.sums_in_fp32 = self.accum_steps > 1 and bool(getattr(optimizer, "masters", None))
        self.skips_on_device = skips_diverged_step_on_device(optimizer, layout.device)
        self.last_metrics: dict[str, float] = {}  # the latest logged values
        # Mixture-of-Experts: the last forward's weighted load-balancing loss and the experts'
        # top-k counts per sparse layer (None for dense models; see the module docstring)
        self.aux_loss = getattr(model, "aux_loss", None)
        self.expert_counts = getattr(model, "expert_counts", None)
        # DeepSeek-V3's selection-bias step after each update (a no-op unless the model's
        # router_bias_update is on)
        self.update_expert_bias = getattr(model, "update_expert_bias", None)

    # ---- one optimizer step -------------------------------------------------------------
    def _micro_batches(self) -> list[dict]:
        device = self.layout.device
        return [
            {k: v.to(device, non_blocking=True) for k, v in next(self.batches).items()}
            for _ in range(self.accum_steps)
        ]

    def _all_reduce(self, tensor: torch.Tensor, group=None) -> torch.Tensor:
        if self.layout.world_size > 1:
            dist.all_reduce(tensor, group=group)
        return tensor

    def train_step(self, preempt_flag: bool) -> dict[str, float]:
        micro_batches = self._micro_batches()
        device = self.layout.device
        # Target tokens of the whole step over all data-parallel ranks: every micro-batch loss
        # is divided by this, so accumulation and data parallelism give the full-batch gradient.
        num_tokens = torch.stack([self.count_targets(mb) for mb in micro_batches]).sum()
        # (a copy: the all-reduce works in place, and .float() of a float count, GRPO's
        # weighted one, is that tensor itself, which the step's stats all-reduce again below)
        global_tokens = self._all_reduce(
            num_tokens.to(torch.float32, copy=True), self.layout.dp_group
        )
        scale = self.layout.dp_size / global_tokens.clamp(min=1)  # FSDP averages over dp ranks
        loss_sum = torch.zeros((), device=device)
        metric_sums: dict[str, torch.Tensor] = {}
        # FSDP reduce-scatters after every micro-batch: skipping it would hold unsharded fp32
        # gradients of the whole model on each device (282 GB for 70B).
        sums: dict[torch.Tensor, torch.Tensor] = {}
        moe = _RoutingSums() if self.aux_loss is not None else None
        for index, batch in enumerate(micro_batches):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
                out = self.loss_step(self.model, batch)
            loss = out.loss_sum * scale
            if moe is not None:  # (before backward: recomputed blocks keep logits again)
                aux = self.aux_loss()  # a mean over this micro-batch's tokens
                loss = loss + aux / self.accum_steps
                moe.add(aux, self.expert_counts() if self.expert_counts else {})
            loss.backward()
            if self.sums_in_fp32:
                add_in_fp32(self.params, sums, last=index == len(micro_batches) - 1)
            loss_sum += out.loss_sum.detach().float()
            for key, value in out.metrics.items():
                metric_sums[key] = metric_sums.get(key, 0) + value.detach().float()
        grad_norm = total_grad_norm([p.grad for p in self.params if p.grad is not None])
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        max_norm = self.cfg.train.max_grad_norm
        if max_norm and not self.skips_on_device:
            clip_grads(self.params, max_norm, grad_norm)
        # One all-reduce and one host sync per step carry the loss, the extra metrics and the
        # preemption flag (TP ranks hold the same loss: numerator and denominator both count it).
        # The flag is filled on the device: torch.tensor(..., device=cuda) would copy it from
        # the host with a blocking copy, which waits for the whole step (a host sync).
        keys = sorted(metric_sums)
        stats = torch.stack(
            [loss_sum, num_tokens.float(), torch.full((), float(preempt_flag), device=device)]
            + [metric_sums[k] for k in keys]
        )
        if moe is not None:  # [aux sum, counts of layer 0 ..., ...] in the same all-reduce
            stats = torch.cat([stats, moe.flat()])
        grad_norm = grad_norm.reshape(1).float().to(device)  # on the CPU under FSDP offload
        stats = torch.cat([self._all_reduce(stats), grad_norm])
        lr = self.scheduler.get_last_lr()[0]
        if self.skips_on_device:
            # Launched before the host sync: the host dispatches the update (DTensor dispatch
            # over every parameter) while the device still computes, rather than the device
            # idling after the sync. A diverged step (loss sum or norm not finite: the same
            # on every rank) is skipped by the fused kernel, its step count included.
            finite = torch.isfinite(stats[0]) & torch.isfinite(stats[-1])
            self._optimizer_step(
                found_inf=(~finite).float(), grad_scale=self._clip_scale(grad_norm)
            )
            # Also before the sync: dropping the gradients took the host 0.6-1 ms with the
            # device idle (1B, 3B on an H200); their memory is reused in stream order.
            self.optimizer.zero_grad(set_to_none=True)
        reduced, stats = stats, stats.tolist()
        grad_norm_value = stats.pop()
        if moe is not None:
            moe_values = stats[3 + len(keys) :]
            del stats[3 + len(keys) :]
        loss = stats[0] / max(stats[1], 1)
        if not (math.isfinite(loss) and math.isfinite(grad_norm_value)):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDivergedError(
                f"step {self.step + 1}: loss is {loss}, grad norm {grad_norm_value}; stopped "
                f"before the update. Last good checkpoint: {self.checkpointer.last_verified or 'none'}"
            )
        if not self.skips_on_device:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if moe is not None and self.update_expert_bias is not None:
            # the step's counts, all-reduced: every rank moves its biases alike (no host copy)
            self.update_expert_bias(moe.layer_counts(reduced[3 + len(keys) : -1]))
        self.step += 1
        # Tokens fed to the model this step over all data-parallel ranks (equal per rank).
        input_tokens = self.layout.dp_size * sum(
            v.numel() for mb in micro_batches for k, v in mb.items() if k.endswith("inputs")
        )
        self.tokens_seen += input_tokens
        values = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm_value,
            "input_tokens": input_tokens,
        }
        values.update({k: v / max(stats[1], 1) for k, v in zip(keys, stats[3:])})
        values["preempt"] = stats[2] > 0
        if moe is not None:
            # every rank (TP ranks too) adds each micro-batch's mean once: divide by all of them
            micro_batch_count = self.layout.world_size * self.accum_steps
            values.update(moe.metrics(moe_values, micro_batch_count))
        if self.batch_metrics is not None:
            values.update(self.batch_metrics(self.step))
        return values

    def _clip_scale(self, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """Gradient clipping as the divisor fused Adam/AdamW applies to every gradient as it
        reads it: max(norm / max_grad_norm, 1), what `clip_grad_norm_` multiplies by, inverted.
        The clip then costs no pass of its own over the gradients (1B on an H200: ~2.5 ms a
        step). None without clipping."""
        max_norm = self.cfg.train.max_grad_norm
        if not max_norm:
            return None
        return ((grad_norm.reshape(()) + 1e-6) / max_norm).clamp(min=1.0)

    def _optimizer_step(self, *, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        """The update, skipped on the device where `found_inf` is 1, every gradient divided by
        `grad_scale` (the attributes torch.amp.GradScaler hands fused Adam/AdamW)."""
        self.optimizer.found_inf = found_inf
        self.optimizer.grad_scale = grad_scale
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf, self.optimizer.grad_scale

    @torch.no_grad()
    def evaluate(self) -> float:
        """The loss over one pass of the held-out batches, normalized like training's, in eval
        mode (no dropout); every rank takes part."""
        device = self.layout.device
        totals = torch.zeros(2, device=device)  # loss sum, targets
        self.model.eval()
        try:
            for batch in self.heldout():
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast):
                    out = self.loss_step(self.model, batch)
                totals += torch.stack(
                    [out.loss_sum.detach().float(), self.count_targets(batch).float()]
                )
        finally:
            self.model.train()
        totals = self._all_reduce(totals)  # TP ranks count twice in both: the ratio holds
        return (totals[0] / totals[1].clamp(min=1)).item()

    # ---- checkpoints --------------------------------------------------------------------
    def _state(self) -> dict:
        return {**self.checkpoint_state, "train": _TrainProgress(self)}

    def restore(self) -> int:
        step = self.checkpointer.restore_latest(self._state())
        if step is not None and self.layout.is_main:  # at any log level: a user must know
            where = self.checkpointer.last_load.path
            print(f"resumed from step {step} ({where})", file=sys.stderr, flush=True)
        return self.step

    def save(self) -> None:
        self.checkpointer.save(self.step, self._state())

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg = self.cfg
        total = cfg.train.steps
        start = self.restore()
        if start > total:
            raise ConfigError(
                f"train.steps = {total} is below step {start}, already checkpointed in "
                f"{self.run_dir}; raise train.steps to continue, or use another run_dir"
            )
        if start == total and self.layout.is_main:
            log.warning(
                "%s is already at step %d of %d: nothing to train", self.run_dir, start, total
            )
        logger = MetricsLogger(
            self.run_dir,
            cfg.metrics,
            enabled=self.layout.is_main,
            total_steps=total,
            start_step=start,
            job_config=self.job_config,
        )
        throughput = Throughput(
            flops_per_token=self.flops_per_token,
            peak_flops=cfg.metrics.peak_flops,
            num_devices=self.layout.world_size,
        )
        watch = active_watch()
        profiler = Profiler(cfg.profile, self.run_dir, self.layout)
        try:
            if start == total and self.export is not None:
                self.export(total, True)  # the stage's output, written again from the weights
            with profiler:
                while self.step < total:
                    values = self.train_step(watch.requested)
                    profiler.step(self.step)
                    throughput.add(values["input_tokens"])
                    evaluate = self.heldout is not None and (
                        self.step % cfg.train.eval_every == 0 or self.step == total
                    )
                    if evaluate:
                        values["val_loss"] = self.evaluate()
                    if (
                        self.step % cfg.metrics.log_every == 0
                        or self.step == total
                        or values["preempt"]
                        or evaluate
                    ):
                        self.last_metrics = self._log_values(values, throughput)
                        logger.log(self.step, self.last_metrics)
                    logger.advance(self.step)
                    if values["preempt"]:
                        self.save()
                        raise PreemptedError(self.step, watch.signal_name)
                    self._maybe_save_and_export(total)
        finally:
            logger.close()
            self.checkpointer.close()
        return self.last_metrics

    def _log_values(self, values: dict, throughput: Throughput) -> dict[str, float]:
        out = {k: v for k, v in values.items() if k not in ("preempt", "input_tokens")}
        out.update(throughput.measure())
        out["peak_mem_gb"] = peak_memory_gb(self.layout.device)
        out["tokens_seen"] = self.tokens_seen
        return out

    def _maybe_save_and_export(self, total: int) -> None:
        every, export_every = self.cfg.checkpoint.every, self.cfg.checkpoint.export_every
        if self.step == total or (every and self.step % every == 0):
            self.save()
        if self.export is not None and (
            self.step == total or (export_every and self.step % export_every == 0)
        ):
            self.export(self.step, self.step == total)


class _RoutingSums:
    """A step's Mixture-of-Experts sums on the device: the auxiliary losses of its micro-batches
    and, per sparse layer, the top-k choices each expert got."""

    def __init__(self) -> None:
        self.aux = None
        self.counts: dict[int, torch.Tensor] = {}

    def add(self, aux: torch.Tensor, counts: dict[int, torch.Tensor]) -> None:
        aux = aux.detach().float().reshape(())
        self.aux = aux if self.aux is None else self.aux + aux
        for layer, value in counts.items():
            self.counts[layer] = self.counts[layer] + value if layer in self.counts else value

    def flat(self) -> torch.Tensor:
        """[1 + layers · E]: the aux sum, then each layer's counts (in layer order)."""
        parts = [self.aux.reshape(1)] + [self.counts[layer] for layer in sorted(self.counts)]
        return torch.cat([part.float().to(self.aux.device) for part in parts])

    def layer_counts(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """Sparse layer index -> its [E] counts, from `flat()`'s layout (all-reduced)."""
        layers = sorted(self.counts)
        per_layer = flat[1:].view(len(layers), -1) if layers else flat[1:]
        return dict(zip(layers, per_layer, strict=True))

    def metrics(self, values: list[float], micro_batch_count: int) -> dict[str, float]:
        """The logged values from `flat()`'s all-reduced numbers (module docstring)."""
        out = {"aux_loss": values[0] / micro_batch_count}
        layers = sorted(self.counts)
        if not layers:
            return out
        num_experts = (len(values) - 1) // len(layers)
        worst = 0.0
        for i, layer in enumerate(layers):
            counts = values[1 + i * num_experts : 1 + (i + 1) * num_experts]
            total = max(sum(counts), 1e-30)
            low, high = min(counts) / total, max(counts) / total
            out[f"expert_load_min/{layer}"] = low
            out[f"expert_load_max/{layer}"] = high
            out[f"expert_load_max_mean/{layer}"] = high * num_experts
            worst = max(worst, high * num_experts)
        out["expert_load_max_mean"] = worst
        return out


class _TrainProgress:
    """Stateful view of the trainer's counters, saved with every checkpoint."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"step": self.trainer.step, "tokens_seen": self.trainer.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.step = int(state["step"])
        self.trainer.tokens_seen = int(state["tokens_seen"])
