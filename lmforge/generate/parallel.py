"""Tensor-parallel inference: one model split over the GPUs of a node, one process per GPU.

Under torchrun (`lmforge launch --nproc N generate|eval ...`), `load_model` builds the model on
the meta device, applies the tensor-parallel plan training uses (lmforge.parallel) without
sequence parallelism (`apply_tensor_parallel(..., sequence_parallel=False)`: a decode step has
one token),
materializes each process's shards and fills them from rank 0's copy of the weights
(broadcast). Attention heads, KV-cache heads and MLP columns are split N ways, and a
Mixture-of-Experts' experts by expert (`split_experts`: expert parallelism over the same
processes, each running its experts' share of every token, summed); the output
projection all-gathers the logits, so every process holds the same logits and makes the same
greedy choice. The model then runs on its local shards as plain tensors, with one all-reduce
after each row-parallel linear and after the embedding lookup, and an all-gather of the logits
(`run_blocks_on_local_shards`, `run_vocabulary_on_local_shards`): a DTensor layer costs tens of
microseconds of Python dispatch per call (an eager prefill or scoring pass makes seven per
block), and a compiled decode step then traces plain tensors and functional collectives
only (the engine captures them in its CUDA graphs after two uncaptured warm-up runs, as NCCL
wants). Each process then runs the same engine on the same prompts (sampled sequences draw
from one seed, `shared_seed`), so each picks the same decode shapes (batch and KV buckets,
from its sequences' lengths) and joins the same collectives, and records the same graphs in
the same order; only rank 0 writes output. Without torchrun
(or with one process) `load_model` is `lmforge.load`.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lmforge import models
from lmforge.api import (
    LoadedModel,
    detect_format,
    load,
    load_tokenizer_for,
    parse_dtype,
    read_args,
    read_state_dict,
)
from lmforge.errors import ConfigError
from lmforge.models import moe
from lmforge.quantize import stored


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def load_model(
    source: str | Path, *, device: str = "auto", dtype: str | torch.dtype | None = None
) -> LoadedModel:
    """The model of `source`, split over the torchrun processes (tensor parallel), or whole
    (experts the hub keeps quantized, gpt-oss's MXFP4, kept so: `load`'s `keep_quantized`)."""
    from lmforge.api import resolve_device

    if world_size() == 1:
        return load(source, device=resolve_device(device), dtype=dtype, keep_quantized=True)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lmforge.parallel import distributed
    from lmforge.parallel.config import ParallelSection
    from lmforge.parallel.tensor_parallel import apply_tensor_parallel

    path = Path(source)
    if detect_format(source) not in ("hf", "artifact") or stored.is_quantized(path):
        raise ConfigError(
            f"{source}: tensor-parallel inference takes a bf16/fp32 artifact or Hugging Face "
            "directory (not a preset, checkpoint or quantized artifact)"
        )
    layout = distributed.setup(ParallelSection(tp=world_size(), dp_shard=1), device)
    args = read_args(path)
    state = read_state_dict(path, args) if layout.is_main else {}
    stored_dtype = next(iter(state.values())).dtype if state else None
    dtype = parse_dtype(dtype) or _broadcast(stored_dtype, layout.is_main)
    with torch.device("meta"):
        model = models.new_model(args).to(dtype)
    apply_tensor_parallel(model, layout.mesh["tp"], sequence_parallel=False)
    split_experts(model, layout.mesh["tp"], source)
    model.to_empty(device=layout.device)
    model.tie_weights()
    model.init_buffers(layout.device)
    state = {name: tensor.to(dtype) for name, tensor in state.items()}
    if args.tie_embeddings and state:  # one parameter under two names
        state["output.weight"] = state["tok_embeddings.weight"]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
    group = layout.mesh["tp"].get_group()
    run_experts_on_local_shards(model, group)
    run_blocks_on_local_shards(model, group)
    run_vocabulary_on_local_shards(model, group)
    tokenizer = load_tokenizer_for(path, args)
    return LoadedModel(model=model.eval(), tokenizer=tokenizer, config=args, source=str(source))


def _sparse_mlps(model: nn.Module) -> list[moe.MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, moe.MoEFeedForward)]


_EXPERT_TENSORS = ("w13", "w2", "b13", "b2")  # stacked [E, ...]: split along the experts


def split_experts(model: nn.Module, tp_mesh, source) -> None:
    """A Mixture-of-Experts' stacked experts split over the tensor-parallel processes along the
    expert dimension (expert parallelism over the tp group: each process holds E / N experts,
    so a model larger than one GPU fits), as meta DTensors the rank-0 broadcast fills."""
    from torch.distributed.tensor import distribute_tensor

    size = tp_mesh.size()
    for mlp in _sparse_mlps(model):
        experts = mlp.experts
        if experts.w13.shape[0] % size:
            raise ConfigError(
                f"{source}: {size} processes must divide the model's {experts.w13.shape[0]} "
                "experts (each process holds an equal share); launch with --nproc dividing it"
            )
        for name in _EXPERT_TENSORS:
            if getattr(experts, name, None) is None:
                continue  # (biases: gpt-oss's only)
            shard = distribute_tensor(getattr(experts, name), tp_mesh, [Shard(0)])
            setattr(experts, name, nn.Parameter(shard, requires_grad=False))


def run_experts_on_local_shards(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Each sparse MLP's experts (`split_experts`) as an `ExpertShard` over this process's
    plain tensors."""
    rank = dist.get_rank(group)
    for mlp in _sparse_mlps(model):
        experts = mlp.experts
        count = experts.w13.to_local().shape[0]
        for name in _EXPERT_TENSORS:
            if getattr(experts, name, None) is not None:
                local = getattr(experts, name).to_local()
                setattr(experts, name, nn.Parameter(local, requires_grad=False))
        mlp.experts = ExpertShard(experts, rank * count, group)


class ExpertShard(nn.Module):
    """This process's experts [start, start + n) of a sparse MLP split over `group`: the pairs
    (token, choice) routed to them run through `local` (n experts, an `moe.Experts`, which
    the engine's fused kernels take as any other), every other pair with weight 0 on local
    expert 0 (fixed shapes: no host sync, one CUDA graph), and the partial outputs are summed
    over the group (every process routes every token alike: the router is replicated)."""

    def __init__(self, local: nn.Module, start: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.local = local
        self.start = start
        self.group = group

    def forward(self, x, weights, experts) -> torch.Tensor:
        index = experts - self.start
        elsewhere = (index < 0) | (index >= self.local.w13.shape[0])
        out = self.local(x, weights.masked_fill(elsewhere, 0), index.masked_fill(elsewhere, 0))
        return funcol.all_reduce(out, "sum", self.group)


def run_blocks_on_local_shards(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Turn each block of a tensor-parallel model (`apply_tensor_parallel` without sequence
    parallelism) into plain modules over this process's shards: every DTensor parameter becomes
    its local tensor, the plan's hooks that wrap and unwrap activations go, and a row-parallel
    linear (weight sharded along its input, Shard(1)) sums its partial outputs over `group`
    (a functional all-reduce, which torch.compile and CUDA graphs take). Column-parallel
    linears already return this process's heads or columns, and replicated norms need nothing.
    The computation is the plan's; only DTensor's per-op dispatch goes. The embedding and the
    output projection: `run_vocabulary_on_local_shards`."""
    for block in model.layers.values():
        for module in block.modules():
            params = dict(module.named_parameters(recurse=False))
            if not any(isinstance(p, DTensor) for p in params.values()):
                continue
            _drop_plan_hooks(module)
            row_parallel = False
            for name, param in params.items():
                row_parallel |= isinstance(module, nn.Linear) and param.placements[0] == Shard(1)
                local = nn.Parameter(param.to_local(), requires_grad=param.requires_grad)
                setattr(module, name, local)
            if row_parallel:
                module.register_forward_hook(_sum_outputs(group))
                if getattr(module, "bias", None) is not None and dist.get_rank(group):
                    module.bias.data.zero_()  # (replicated: added once by the sum)


def run_vocabulary_on_local_shards(model: nn.Module, group: dist.ProcessGroup) -> None:
    """The embedding and the output projection of a tensor-parallel model (the plan splits
    both by vocabulary rows) on their local rows too, as plain modules: the lookup takes this
    process's rows and zeros for the other processes' tokens, summed over `group`; the output
    projection's logits for its rows are gathered along the vocabulary. A tied table stays one
    parameter. A vocabulary that does not split evenly keeps DTensor's layers (a gather needs
    equal parts)."""
    table = model.tok_embeddings.weight
    size = dist.get_world_size(group)
    if model.args.vocab_size % size or not isinstance(table, DTensor):
        return
    rows = model.args.vocab_size // size
    model.tok_embeddings = VocabularyShard(table.to_local(), dist.get_rank(group) * rows, group)
    output = model.output
    _drop_plan_hooks(output)
    if model.args.tie_embeddings:
        model.tie_weights()
    else:
        output.weight = nn.Parameter(output.weight.to_local(), requires_grad=False)
    output.register_forward_hook(_gather_vocabulary(group))


class VocabularyShard(nn.Embedding):
    """Embedding rows [start, start + rows) of the table: tokens [...] -> their vectors
    [..., dim], summed over `group` (each token's row lives on one process)."""

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup) -> None:
        super().__init__(*weight.shape, _weight=weight, _freeze=True)
        self.start = start
        self.group = group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        vectors = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return funcol.all_reduce(vectors.masked_fill(elsewhere[..., None], 0), "sum", self.group)


# torch 2.13 renamed all_gather_tensor (which now warns on every eager call); 2.11 may lack it.
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)


def _gather_vocabulary(group: dist.ProcessGroup):
    def hook(module, inputs, logits: torch.Tensor) -> torch.Tensor:  # [..., rows] -> [..., vocab]
        return _all_gather(logits, gather_dim=logits.dim() - 1, group=group)

    return hook


def _drop_plan_hooks(module: nn.Module) -> None:
    """Remove the hooks with which the plan turns a module's inputs and outputs into DTensors
    and back (parallelize_module registers them without handles: distribute_module)."""
    module._forward_pre_hooks.clear()
    module._forward_hooks.clear()


def _sum_outputs(group: dist.ProcessGroup):
    def hook(module, inputs, output: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(output, "sum", group)

    return hook


@contextlib.contextmanager
def main_process_output() -> Iterator[None]:
    """Under torchrun, silence stdout and stderr of every process but rank 0."""
    if is_main():
        yield
        return
    with (
        open(os.devnull, "w") as quiet,
        contextlib.redirect_stdout(quiet),
        contextlib.redirect_stderr(quiet),
    ):
        yield


def shared_seed(seed: int | None) -> int | None:
    """`seed`, or under torchrun one random seed that every process uses (sampling must agree)."""
    if seed is not None or world_size() == 1:
        return seed
    return _broadcast(random.randrange(2**62), is_main())


def send_to_others(*value) -> None:
    """Rank 0: broadcast `value` (a tuple) to the other processes (`receive_from_main`)."""
    _broadcast(value, True)


def receive_from_main():
    """What rank 0 sent with `send_to_others`."""
    return _broadcast(None, False)


def gather_from_all(value) -> list:
    """Every process's `value`, in rank order, on every process (`[value]` without torchrun)."""
    if world_size() == 1:
        return [value]
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def _broadcast(value, is_source: bool):
    """Rank 0's `value`, on every process."""
    box = [value if is_source else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
