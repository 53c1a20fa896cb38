"""How parallelism and the memory planner see a Llama block: the tensor-parallel plan and the
parameter shapes.

The plan is Megatron-style: attention heads and MLP columns split across the tp axis; in
training the norms and the residual stream are sharded along the sequence (sequence parallel),
so each block takes and returns a sequence-sharded residual. `lmforge.train.parallelize`
applies it.
"""

from __future__ import annotations

from lmforge.models.family import ParamShape
from lmforge.models.llama.args import ModelArgs


def block_params(args: ModelArgs, layer: int | None = None) -> list[ParamShape]:
    """One block's parameters in the model's order, with the dimension TP splits (0: columns
    of a column-parallel linear, 1: rows of a row-parallel one); every block (`layer`) alike."""
    d = args.dim
    return [
        ParamShape("attention_norm.weight", (d,), "norm"),
        ParamShape("attention.wq.weight", (args.q_dim, d), "linear", 0),
        ParamShape("attention.wk.weight", (args.kv_dim, d), "linear", 0),
        ParamShape("attention.wv.weight", (args.kv_dim, d), "linear", 0),
        ParamShape("attention.wo.weight", (d, args.q_dim), "linear", 1),
        ParamShape("ffn_norm.weight", (d,), "norm"),
        ParamShape("feed_forward.w1.weight", (args.ffn_dim, d), "linear", 0),
        ParamShape("feed_forward.w2.weight", (d, args.ffn_dim), "linear", 1),
        ParamShape("feed_forward.w3.weight", (args.ffn_dim, d), "linear", 0),
    ]


def tp_plan(*, sequence_parallel: bool = True) -> dict:
    """Per block: module name -> ParallelStyle (torch.distributed.tensor.parallel). Without
    `sequence_parallel` (inference) the norms are replicated and the residual stream too."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sequence_parallel:
        plan |= {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None),
            ),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
        }
    return plan


def replicated_mlp():
    """The style of a sparse MLP replicated over the tp axis in training: the whole sequence
    in (gathered from the sequence-sharded residual stream), plain tensors inside, its output
    handed back sharded, so each rank computes the same MLP and gets the same gradients."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,  # the residual stream is local shards, as in Llama
    )
