"""How parallelism and the memory planner see a Qwen3 block: Llama's, plus the head norms.

Under tensor parallelism each rank holds whole heads, so the head norms run on local heads
with a replicated weight; `SequenceParallel(sequence_dim=2)` marks their input as sharded along
the heads dimension of [b, s, heads, head_dim], which makes the weight's gradient the sum over
the tp ranks (each sees other heads).
"""

from __future__ import annotations

from lmforge.models.family import ParamShape
from lmforge.models.llama import plan as llama_plan
from lmforge.models.qwen3.args import ModelArgs


def block_params(args: ModelArgs, layer: int | None = None) -> list[ParamShape]:
    params = llama_plan.block_params(args, layer)
    after_wo = [p.name for p in params].index("attention.wo.weight") + 1
    params[after_wo:after_wo] = [
        ParamShape("attention.q_norm.weight", (args.head_dim,), "head_norm", reads="wq"),
        ParamShape("attention.k_norm.weight", (args.head_dim,), "head_norm", reads="wk"),
    ]
    return params


def tp_plan(*, sequence_parallel: bool = True) -> dict:
    """Llama's plan for the block, plus the head norms on each rank's own heads."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return llama_plan.tp_plan(sequence_parallel=sequence_parallel) | {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
