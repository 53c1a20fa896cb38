"""How parallelism and the memory planner see a gpt-oss block.

The planner's shapes: Llama's attention projections plus their biases and the sinks (small
vectors, counted with the norms), the router with its bias, and the stacked experts with
theirs. Tensor parallelism is not planned for gpt-oss yet (the sinks and biases would split by
head): `tp_plan` refuses it with a clear error.
"""

from __future__ import annotations

from lmforge.errors import ConfigError
from lmforge.models.family import ParamShape
from lmforge.models.gpt_oss.args import ModelArgs
from lmforge.models.llama import plan as llama_plan


def block_params(args: ModelArgs, layer: int | None = None) -> list[ParamShape]:
    """A block's parameters (every block is sparse)."""
    params = llama_plan.block_params(args, layer)
    params = [p for p in params if not p.name.startswith("feed_forward.")]
    d, e, f = args.dim, args.num_experts, args.ffn_dim
    vectors = [
        ("attention.wq.bias", args.q_dim),
        ("attention.wk.bias", args.kv_dim),
        ("attention.wv.bias", args.kv_dim),
        ("attention.wo.bias", d),
        ("attention.sinks", args.num_heads),
        ("feed_forward.router.bias", e),
    ]
    params += [ParamShape(name, (size,), "norm") for name, size in vectors]
    params += [
        ParamShape("feed_forward.router.weight", (e, d), "linear"),
        ParamShape("feed_forward.experts.w13", (e, 2 * f, d), "experts"),
        ParamShape("feed_forward.experts.b13", (e, 2 * f), "norm"),
        ParamShape("feed_forward.experts.w2", (e, d, f), "experts"),
        ParamShape("feed_forward.experts.b2", (e, d), "norm"),
    ]
    return params


def tp_plan(*, sequence_parallel: bool = True) -> dict:
    raise ConfigError(
        "tensor parallelism (parallel.tp > 1, or `lmforge launch --nproc N generate`) is not "
        "supported for gpt-oss yet; run it on one process, with FSDP (parallel.dp_shard) to train"
    )
