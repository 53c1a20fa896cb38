"""How parallelism and the memory planner see a gpt-oss block.

The planner's shapes: Llama's attention projections plus their biases and the sinks (small
vectors, counted with the norms), the router with its bias, and the stacked experts with
theirs. Tensor parallelism is planned for inference (attention split by head, sinks
included); in training it is refused with a clear error.
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
    """Inference (no sequence parallelism): Llama's attention plan (the projections' biases
    split with their columns, wo's replicated) with each rank's heads' sinks, the sparse MLP
    replicated (`lmforge launch --nproc N generate` then splits the experts by expert).
    Training under tensor parallelism is refused: not planned for gpt-oss yet."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    if sequence_parallel:
        raise ConfigError(
            "tensor parallelism in training (parallel.tp > 1) is not supported for gpt-oss yet; "
            "train with FSDP (parallel.dp_shard)"
        )

    class HeadSinks(ParallelStyle):
        """An attention module's `sinks` [heads] split by head over the tp ranks."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            def partition(name: str, child: nn.Module, mesh) -> None:
                if name == "":
                    shard = distribute_tensor(child.sinks, mesh, [Shard(0)])
                    child.sinks = nn.Parameter(shard, requires_grad=child.sinks.requires_grad)

            return distribute_module(module, device_mesh, partition)

    attention = {
        name: style
        for name, style in llama_plan.tp_plan(sequence_parallel=False).items()
        if name.startswith("attention.")
    }
    return attention | {"attention": HeadSinks()}
