"""The model GRPO's rollout engine samples from where it is not the policy module itself.

The engine runs a plain module, step after step, on each rank; a parallelized policy is not one:

- FSDP2 (`GatheredReplica`): the weights are sharded over the data-parallel ranks and each
  forward would gather them. The replica is an unsharded model of the policy's structure on
  each rank, in the dtype the trainer computes in (FSDP's mixed precision: bf16), QLoRA's
  bases in NF4 as packed; before each rollout the full weights are gathered into it (with
  LoRA only the adapters, after the first time).
- Tensor parallelism (`TensorParallelReplica`): the replica is the inference layout of the same
  plan (lmforge.generate.parallel: each block on its local shards, one functional all-reduce
  after each row-parallel linear, the logits gathered over the vocabulary), whose parameters
  are this rank's shards of the policy's. Where the policy stores them in the dtype it computes
  in and without FSDP, they are the policy's own tensors, which the optimizer updates in place:
  nothing is copied, ever. Otherwise each rollout copies them in (fp32 weights computing in
  bf16: else every decode step would cast every weight again), with FSDP gathering the
  data-parallel shards of this rank's tensor-parallel shard.
- One process, grpo.fuse_rollouts (`FusedReplica`): the policy's own tensors, but each block's
  q/k/v and gate/up weights fused into one matmul each (`Transformer.fuse_projections`), copies
  refreshed before each rollout.

A replica that holds copies is fused too (no more memory: the copies are made anyway); LoRA
models stay unfused. `make_replica` picks one (or none: one process samples from the policy
module itself).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from lmforge import models
from lmforge.errors import ConfigError
from lmforge.modules.lora import (
    WRAPPER_PREFIX,
    apply_lora,
    frozen_dtype,
    is_nf4,
    lora_modules,
    nf4_placeholders,
    nf4_to_empty,
)


def make_replica(policy: nn.Module, spec, layout, lora, *, bf16: bool, fuse: bool = False):
    """The replica a policy parallelized over `layout` samples from, or None (one process,
    unless `fuse`: grpo.fuse_rollouts). `bf16`: the trainer computes in bf16."""
    if layout.tp_size > 1:
        return TensorParallelReplica(policy, spec.args, layout, bf16=bf16)
    if hasattr(policy, "set_requires_gradient_sync"):  # FSDP2's
        return GatheredReplica(
            policy, lambda: unsharded_model(spec.args, lora, layout.device, bf16)
        )
    return FusedReplica(policy, spec.args, layout.device) if fuse and lora is None else None


def unsharded_model(args, lora, device: torch.device, bf16: bool) -> nn.Module:
    """A model of the policy's structure (its LoRA adapters, QLoRA's NF4 bases) on `device`,
    in bf16 where the trainer computes in it (else its frozen linears in lora.base_dtype),
    weights unset."""
    with torch.device("meta"):
        model = models.new_model(args)
    if lora is not None:
        base_dtype = frozen_dtype(lora, bf16)
        apply_lora(
            model, targets=lora.targets, rank=lora.rank, alpha=lora.alpha, base_dtype=base_dtype
        )
    if bf16:
        model.to(torch.bfloat16)  # (meta tensors: nothing moves)
    if lora is not None and lora.quantize_base == "nf4":  # filled from the NF4 bases, as packed
        nf4_placeholders(model, num_shards=1)
    model.to_empty(device=device)
    for module in lora_modules(model).values():
        for weight in module.parameters(recurse=False):
            if is_nf4(weight):
                nf4_to_empty(weight)
    model.tie_weights()
    model.init_buffers(device)
    return model.requires_grad_(False).eval()


class GatheredReplica:
    """An unsharded copy of an FSDP2 policy's weights (`make()` builds it at the first rollout),
    gathered before each rollout: a collective, every rank calls `model()` once a rollout."""

    summary = "an unsharded copy on each rank, gathered from the FSDP shards before each rollout"

    def __init__(self, policy: nn.Module, make) -> None:
        self.policy, self.make = policy, make
        self.module: nn.Module | None = None

    def model(self) -> nn.Module:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        first = self.module is None
        if first:
            self.module = self.make()
            self.module.fuse_projections()  # (not with LoRA) joined again at each load
        trainable_only = not first and any(not p.requires_grad for p in self.policy.parameters())
        options = StateDictOptions(full_state_dict=True, ignore_frozen_params=trainable_only)
        state = get_model_state_dict(self.policy, options=options)
        with torch.no_grad():
            unexpected = self.module.load_state_dict(state, strict=False).unexpected_keys
        assert not unexpected, f"the replica lacks {unexpected[:3]}"
        return self.module


class TensorParallelReplica:
    """The policy's tensor-parallel shards in inference's layout (module docstring)."""

    def __init__(self, policy: nn.Module, args, layout, *, bf16: bool) -> None:
        if args.vocab_size % layout.tp_size:
            raise ConfigError(
                f"lmforge grpo with parallel.tp = {layout.tp_size} needs a vocabulary that splits "
                f"evenly over it (vocab_size {args.vocab_size}): the rollouts gather the logits"
            )
        self.policy, self.args, self.layout = policy, args, layout
        stored = {p.dtype for p in policy.parameters()}
        if bf16:
            self.dtype = torch.bfloat16
        else:
            self.dtype = stored.copy().pop() if len(stored) == 1 else torch.float32
        # FSDP shards each tensor-parallel shard further; another dtype is a copy too
        self.copies = layout.dp_size > 1 or stored != {self.dtype}
        self.module: nn.Module | None = None
        heads = f"{args.num_kv_heads // layout.tp_size} of {args.num_kv_heads} KV heads"
        how = "the policy's own tensors (no copy)"
        if self.copies:
            source = "gathered from the FSDP shards" if layout.dp_size > 1 else "made"
            how = f"{str(self.dtype).removeprefix('torch.')} copies {source} before each rollout"
        self.summary = f"this rank's tensor-parallel shards ({heads}): {how}"

    def model(self) -> nn.Module:
        from lmforge.generate.parallel import (
            run_blocks_on_local_shards,
            run_vocabulary_on_local_shards,
        )
        from lmforge.parallel.tensor_parallel import apply_tensor_parallel

        if self.module is not None and not self.copies:
            return self.module  # the policy's own tensors, updated in place
        first = self.module is None
        if first:
            tp = self.layout.mesh["tp"]
            with torch.device("meta"):
                model = models.new_model(self.args)
            apply_tensor_parallel(model, tp, sequence_parallel=False)
            run_blocks_on_local_shards(model, tp.get_group())
            run_vocabulary_on_local_shards(model, tp.get_group())
            if self.copies:
                model.to(self.dtype).to_empty(device=self.layout.device)
                model.fuse_projections()  # its local rows; joined again at each load
            self.module = model
        state = {name: self._local_shard(p) for name, p in policy_parameters(self.policy)}
        with torch.no_grad():
            # No copies: the replica's parameters become the policy's local tensors (assign).
            loaded = self.module.load_state_dict(state, strict=False, assign=not self.copies)
        assert not loaded.unexpected_keys, f"the replica lacks {loaded.unexpected_keys[:3]}"
        if first:
            self.module.tie_weights()
            self.module.init_buffers(self.layout.device)
            self.module.requires_grad_(False).eval()
        return self.module

    def _local_shard(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel shard of `param`, gathered over the data-parallel mesh
        dimensions (FSDP2's) where it has them; without them the local tensor itself."""
        if not isinstance(param, DTensor):
            return param.detach()
        mesh = param.device_mesh
        placements = [
            placement if name == "tp" else Replicate()
            for name, placement in zip(mesh.mesh_dim_names, param.placements)
        ]
        if list(placements) != list(param.placements):
            param = param.redistribute(mesh, placements)
        return param.to_local().detach()


class FusedReplica:
    """One process: the policy's own tensors, with each block's q/k/v and gate/up weights fused
    into copies (module docstring), which every rollout refreshes from the policy."""

    FUSED = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
    summary = "the policy's own tensors, q/k/v and gate/up fused into copies made each rollout"

    def __init__(self, policy: nn.Module, args, device: torch.device) -> None:
        self.policy, self.args, self.device = policy, args, device
        self.module: nn.Module | None = None

    def model(self) -> nn.Module:
        with torch.no_grad():
            if self.module is not None:  # the fused copies, joined again from the policy's
                fused = {n: p.detach() for n, p in policy_parameters(self.policy) if self._fused(n)}
                self.module.load_state_dict(fused, strict=False)
                return self.module
            with torch.device("meta"):
                model = models.new_model(self.args)
            state = {name: p.detach() for name, p in policy_parameters(self.policy)}
            model.load_state_dict(state, strict=False, assign=True)  # the policy's tensors
            model.tie_weights()
            model.init_buffers(self.device)
            model.requires_grad_(False).eval()
            model.fuse_projections()  # the fused weights: copies
            self.module = model
        return self.module

    def _fused(self, name: str) -> bool:
        return name.removesuffix(".weight").endswith(self.FUSED)


def policy_parameters(policy: nn.Module):
    """(state-dict name, parameter) of the policy (activation checkpointing's wrappers cut)."""
    for name, param in policy.named_parameters():
        yield name.replace(WRAPPER_PREFIX, ""), param
