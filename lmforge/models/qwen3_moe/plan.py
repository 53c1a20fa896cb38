"""How parallelism and the memory planner see a Qwen3-MoE block.

Tensor parallelism splits attention only (Qwen3's plan for it); every MLP, the experts, their
router and a dense layer's SwiGLU alike, is replicated over the tp axis for now (expert
parallelism, which would split the experts, is parallel/'s to add). In training the replicated
MLP takes the whole sequence: its input is gathered from the sequence-sharded residual and its
output handed back sharded, so each rank computes the same MLP and gets the same gradients.

The planner's "experts" kind is a stacked [E, out, in] weight: a matmul weight LoRA does not
adapt, replicated over tp.
"""

from __future__ import annotations

import dataclasses

from lmforge.models.family import ParamShape
from lmforge.models.llama import plan as llama_plan
from lmforge.models.qwen3 import plan as qwen3_plan
from lmforge.models.qwen3_moe.args import ModelArgs


def block_params(args: ModelArgs, layer: int | None = None) -> list[ParamShape]:
    """Block `layer`'s parameters (None: the first sparse block's, the typical one); every MLP
    replicated over tp (`tp_plan`)."""
    params = qwen3_plan.block_params(args)
    mlp = [p for p in params if p.name.startswith("feed_forward.")]
    where = params.index(mlp[0])
    if layer is None:
        layer = next(iter(args.moe_layers), 0)
    if not args.is_moe_layer(layer):
        params[where : where + len(mlp)] = [dataclasses.replace(p, tp_dim=None) for p in mlp]
        return params
    d, e, f = args.dim, args.num_experts, args.moe_ffn_dim
    params[where : where + len(mlp)] = [
        ParamShape("feed_forward.router.weight", (e, d), "linear"),
        ParamShape("feed_forward.experts.w13", (e, 2 * f, d), "experts"),
        ParamShape("feed_forward.experts.w2", (e, d, f), "experts"),
    ]
    return params


def tp_plan(*, sequence_parallel: bool = True) -> dict:
    """Qwen3's plan for attention and the norms; the MLP replicated (see the module doc)."""
    plan = {
        name: style
        for name, style in qwen3_plan.tp_plan(sequence_parallel=sequence_parallel).items()
        if not name.startswith("feed_forward")
    }
    if sequence_parallel:  # whole sequence in, plain tensors inside, sharded back out
        plan["feed_forward"] = llama_plan.replicated_mlp()
    return plan
