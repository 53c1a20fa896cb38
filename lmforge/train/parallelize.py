"""`parallelize(model, layout, cfg)`: the one place parallelism is applied, from outside the model.

Order (each step sees the result of the previous one): float8 conversion → tensor parallel plan
(DTensor; sequence parallel for the norms) → expert parallelism (the experts split over the ep
axis) → activation checkpointing → per-block torch.compile → FSDP2 per block (a block's experts
first, over the ranks left beside ep), then the root. The model is built on the meta device
before this and materialized after it, so no rank ever holds the full unsharded model.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lmforge.errors import ConfigError
from lmforge.models import Transformer
from lmforge.parallel.config import ParallelSection
from lmforge.parallel.distributed import Layout
from lmforge.parallel.expert_parallel import apply_expert_parallel, expert_parallel_modules
from lmforge.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(
    model: Transformer, layout: Layout, cfg: ParallelSection, *, bf16: bool
) -> Transformer:
    """Apply the configured parallelism in place and return the model.

    Args:
        layout: process layout with the device mesh (None mesh: one process).
        cfg: its reshard_after_forward resolved to a bool (`resolve_reshard_after_forward`).
        bf16: compute in bf16 (FSDP2 mixed precision: bf16 params in compute, fp32 reductions).
    """
    if cfg.float8:
        convert_to_float8(model, layout)
    if layout.tp_size > 1:
        apply_tensor_parallel(model, layout.mesh["tp"])
    if layout.ep_size > 1:
        apply_expert_parallel(model, layout.ep_mesh)
    if cfg.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        for block in model.layers.values():
            block.compile(fullgraph=True)  # in place: parameter names stay unchanged
    if layout.dp_size > 1 or cfg.cpu_offload:
        apply_fsdp(model, layout, cfg, bf16=bf16)
    return model


def convert_to_float8(model: Transformer, layout: Layout) -> None:
    if layout.device.type != "cuda" or torch.cuda.get_device_capability(layout.device) < (8, 9):
        raise ConfigError(
            "parallel.float8 = true needs a CUDA GPU with float8 support (compute capability "
            ">= 8.9: H100, H200, L40S, B200); set parallel.float8 = false here"
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError("parallel.float8 = true needs torchao: pip install torchao") from None

    def wanted(module: nn.Module, name: str) -> bool:
        # float8 matmuls need dims divisible by 16; the output projection stays in bf16.
        return (
            isinstance(module, nn.Linear)
            and name != "output"
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=wanted)


# Ops whose outputs selective checkpointing keeps (expensive to recompute); everything else
# (norms, activations, rotary embedding) is recomputed in the backward pass.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_context():
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            # Keep every other matmul output: half the matmul recompute for half the memory.
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            keep = counts[key] % 2 == 0
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        if op in _SAVE_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    for name, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(
                block, context_fn=_selective_context, preserve_rng_state=False
            )
        model.layers[name] = wrapped


def apply_fsdp(model: Transformer, layout: Layout, cfg: ParallelSection, *, bf16: bool) -> None:
    mesh = layout.dp_mesh if layout.mesh is not None else None
    policy = (
        MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, cfg.reduce_dtype)
        )
        if bf16
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    assert isinstance(cfg.reshard_after_forward, bool), "resolve_reshard_after_forward first"
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = cfg.reshard_after_forward and index < len(blocks) - 1
        for experts in expert_parallel_modules(block):
            # Each rank's own experts, sharded over the ranks that hold the same ones.
            fully_shard(
                experts,
                mesh=layout.expert_dp_mesh,
                mp_policy=policy,
                offload_policy=offload,
                reshard_after_forward=reshard,
            )
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=reshard,
        )
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=policy,
        offload_policy=offload,
        reshard_after_forward=cfg.reshard_after_forward,
    )
