"""Tensor parallelism as training and inference both apply it: the family's block plan (from
models/<family>/plan.py) and the root's (embedding and output projection split by vocabulary),
with sequence parallelism for training or replicated activations for inference.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge import models
from lmforge.errors import ConfigError
from lmforge.models import Transformer


def apply_tensor_parallel(model: Transformer, tp_mesh, *, sequence_parallel: bool = True) -> None:
    """Megatron-style TP: attention heads and MLP columns split across the tp axis. With
    `sequence_parallel` (training) the norms and the residual stream are sharded along the
    sequence; without it (inference: a decode step has one token) they are replicated and each
    block ends in an all-reduce. The blocks' plan is the family's (models/<family>/plan.py)."""
    if model.args.num_kv_heads % tp_mesh.size():
        raise ConfigError(
            f"parallel.tp = {tp_mesh.size()} must divide the model's num_kv_heads "
            f"({model.args.num_kv_heads})"
        )
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    norm = SequenceParallel() if sequence_parallel else None
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, root | ({"norm": norm} if norm else {}))
    block_plan = models.family_of(model.args).tp_plan  # the family's own module names
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel=sequence_parallel))
    # Both tables are sharded by vocabulary rows (Shard(0)): one DTensor serves as both, so a
    # tied model stays tied (parallelize_module gave each module its own copy).
    model.tie_weights()
