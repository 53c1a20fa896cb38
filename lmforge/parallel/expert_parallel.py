"""Expert parallelism (parallel.ep): a Mixture-of-Experts block's experts split over the `ep` axis
of the device mesh, tokens sent to their experts' ranks and back by all-to-all (as in GShard,
Lepikhin et al., 2020, and torchtitan's ExpertParallel).

Applied from outside the model, like the tensor-parallel plan: each `Experts` module of the
model (models/moe.py) keeps its parameter names, but `w13` [E, 2I, dim] and `w2` [E, dim, I]
become DTensors sharded along dim 0 over the ep mesh (rank r holds experts r·E/ep ..
(r+1)·E/ep - 1), and its forward becomes `dispatch_combine`. FSDP2 then shards those local
experts over the remaining data-parallel ranks (`Layout.expert_dp_mesh`), which DTensor's
2-D placements (FSDP+EP, as FSDP+TP) describe, so DCP checkpoints save and resume them and a
full state dict (the artifact) gathers every expert.

The forward on each rank: route locally (the router and the load-balancing loss see only this
rank's tokens, as without ep), sort the token-expert assignments by expert (so by owning
rank), all-to-all the per-expert counts, all-to-all the token rows, run the local experts on
the received rows (`expert_outputs`: the loop or the grouped path), all-to-all the results
back, and add them to their tokens weighted by the routing weights. The counts are read on the
host to size the row all-to-alls: one host sync per block and forward (and per backward); a
GPU path that sizes the buffers without it (padding or a device-side split) is future work.

Gradients: an expert's gradient on its owner sums every ep rank's tokens (the all-to-all's
backward brings them home), and FSDP2 averages it over the other dp_replicate × dp_shard / ep
ranks; scaling it by 1 / ep (`_ScaleGradient`) makes it the mean over all dp ranks, as every
other parameter's gradient is (train/loop.py scales losses for that mean).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lmforge.errors import ConfigError
from lmforge.models.moe import ExpertAdapters, ExpertBiases, combine, expert_outputs, is_experts
from lmforge.modules.lora import LoRAExperts


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times `factor` in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    grouped: bool | None = None,
    biases: ExpertBiases | None = None,
    lora: ExpertAdapters | None = None,
) -> torch.Tensor:
    """`expert_outputs(x, W13, W2, weights, experts)` with the full weights W13, W2 split over
    the ranks of `group`: this rank's `w13` [E/ep, 2I, dim] and `w2` [E/ep, dim, I] are experts
    rank·E/ep onwards (and `biases`' b13 [E/ep, 2I], b2 [E/ep, dim]: gpt-oss's; `lora`'s
    adapters of those experts). x [tokens, dim], weights and experts [tokens, k] -> [tokens,
    dim]."""
    ep = group.size()
    num_local = w13.shape[0]
    num_experts = num_local * ep
    top_k = experts.shape[1]
    flat = experts.reshape(-1)  # [tokens * k]: assignment a is token a // k's choice a % k
    order = torch.argsort(flat, stable=True)  # grouped by expert, so by the rank owning it
    token = order // top_k
    counts = torch.bincount(flat, minlength=num_experts)  # [E] rows this rank sends each expert
    received_counts = torch.empty_like(counts)  # [ep · E/ep]: from each rank, for each local one
    dist.all_to_all_single(received_counts, counts, group=group)
    received_counts = received_counts.view(ep, num_local)
    # The one host sync: the rows' split sizes, both ways, in one copy.
    sizes = torch.cat([counts.view(ep, num_local).sum(1), received_counts.sum(1)]).tolist()
    send, receive = sizes[:ep], sizes[ep:]
    rows = x[token]  # [tokens * k, dim], by expert
    received = all_to_all_single(
        rows.new_empty(sum(receive), x.shape[1]), rows, receive, send, group=group
    )  # [n, dim]: from rank 0 (its rows for local expert 0, 1, ...), then rank 1, ...
    local_expert = torch.arange(num_local, device=x.device).repeat(ep)
    local_expert = torch.repeat_interleave(local_expert, received_counts.reshape(-1))  # [n]
    ones = torch.ones(len(local_expert), 1, dtype=received.dtype, device=x.device)
    y = expert_outputs(
        received, w13, w2, ones, local_expert[:, None], grouped=grouped, biases=biases, lora=lora
    )
    if received.shape[0] == 0:  # no rows: still a (zero) gradient, as the other ranks have one
        held = [w13, w2] + ([biases.b13, biases.b2] if biases is not None else [])
        held += [lora.a13, lora.b13, lora.a2, lora.b2] if lora is not None else []
        y = y + 0 * sum(w.sum() for w in held)
    back = all_to_all_single(rows.new_empty(rows.shape), y, send, receive, group=group)
    return combine(back, order, weights).to(x.dtype)


class ExpertParallel:
    """Mixed into an `Experts`, `BiasedExperts` or `LoRAExperts` module's class by
    `apply_expert_parallel`: the same parameters (DTensors sharded along dim 0 over the ep
    mesh; a LoRA's adapters with their experts), a forward through `dispatch_combine`."""

    ep_group: dist.ProcessGroup

    def forward(self, x, weights, experts) -> torch.Tensor:
        ep = self.ep_group.size()
        local = {
            name: _ScaleGradient.apply(w.to_local() if isinstance(w, DTensor) else w, 1.0 / ep)
            for name, w in self.named_parameters()  # ("lora_a.w13": a LoRA's, recursed into)
        }
        biases = lora = None
        if "b13" in local:
            biases = ExpertBiases(local["b13"], local["b2"], self.activation)
        if "lora_a.w13" in local and not self.disabled:
            a13, b13, a2, b2 = (local[f"lora_{ab}.{w}"] for w in ("w13", "w2") for ab in "ab")
            lora = ExpertAdapters(a13, b13, a2, b2, self.scale)
        return dispatch_combine(
            x, weights, experts, local["w13"], local["w2"], self.ep_group,
            grouped=self.grouped, biases=biases, lora=lora,
        )  # fmt: skip


def _shard(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    if param.is_meta:  # (the usual case: built on the meta device, materialized later)
        local = param.new_empty(param.shape[0] // mesh.size(), *param.shape[1:])
        tensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    else:
        tensor = distribute_tensor(param.detach(), mesh, [Shard(0)])
    return nn.Parameter(tensor, requires_grad=param.requires_grad)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The model's stacked-experts modules, LoRA's included (none for a dense model)."""
    return [m for m in model.modules() if is_experts(m) or isinstance(m, LoRAExperts)]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every `Experts` module's experts over `ep_mesh` (in place; before FSDP2)."""
    ep = ep_mesh.size()
    found = expert_modules(model)
    if not found:
        raise ConfigError(
            f"parallel.ep = {ep} needs a Mixture-of-Experts model (this one has no experts); "
            "set parallel.ep = 1"
        )
    for module in found:
        num_experts = module.w13.shape[0]
        if num_experts % ep:
            allowed = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise ConfigError(
                f"parallel.ep = {ep} must divide the model's num_experts ({num_experts}); "
                f"allowed: {allowed}"
            )
        for name, param in list(module.named_parameters()):
            owner, _, leaf = name.rpartition(".")  # (a LoRA's: "lora_a.w13")
            setattr(module.get_submodule(owner), leaf, _shard(param, ep_mesh))  # [E, ...] each
        module.ep_group = ep_mesh.get_group()
        cls = type(module)
        module.__class__ = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """The modules `apply_expert_parallel` converted (FSDP2 shards them over their own mesh)."""
    return [module for module in model.modules() if isinstance(module, ExpertParallel)]
