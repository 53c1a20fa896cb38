"""How parallelism and the memory planner see a gpt-oss block.

The planner's shapes: Llama's attention projections plus their biases and the sinks (small
vectors, counted with the norms), the router with its bias, and the stacked experts with
theirs. Tensor parallelism splits attention by head (sinks included) and replicates the
sparse MLP, in training and inference.
"""

from __future__ import annotations

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
    """Llama's plan for attention (the projections' biases split with their columns, wo's
    replicated and added once) with each rank's heads' sinks; the sparse MLP replicated: in
    training it takes the whole sequence (`llama_plan.replicated_mlp`), in inference `lmforge
    launch --nproc N generate` then splits the experts by expert."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class HeadSinks(ParallelStyle):
        """An attention module's `sinks` [heads] split by head over the tp ranks, after
        `then` (the module's own style, if any)."""

        def __init__(self, then: ParallelStyle | None = None) -> None:
            super().__init__()
            self.then = then

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            if self.then is not None:
                module = self.then._apply(module, device_mesh)

            def partition(name: str, child: nn.Module, mesh) -> None:
                if name == "":
                    shard = distribute_tensor(child.sinks, mesh, [Shard(0)])
                    child.sinks = nn.Parameter(shard, requires_grad=child.sinks.requires_grad)

            return distribute_module(module, device_mesh, partition)

    llama = llama_plan.tp_plan(sequence_parallel=sequence_parallel)
    plan = {name: style for name, style in llama.items() if not name.startswith("feed_forward")}
    plan["attention"] = HeadSinks(then=plan.get("attention"))
    if sequence_parallel:
        plan["feed_forward"] = llama_plan.replicated_mlp()
    return plan
