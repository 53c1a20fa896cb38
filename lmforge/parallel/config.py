"""`ParallelSection`: how a job's processes split the model (data-parallel replicas and shards,
tensor parallelism) and what training's `parallelize()` applies around them (activation
checkpointing, torch.compile, float8, FSDP2's options). Training reads all of it; tensor-parallel
inference builds one with `tp` only. It lives here, below both, so that neither imports the other.
"""

from __future__ import annotations

from typing import Literal

from pydantic import PositiveInt, field_validator, model_validator

from lmforge.config import Section


class ParallelSection(Section):
    """World size = dp_replicate × dp_shard × tp. dp_shard=-1 takes what is left."""

    dp_replicate: PositiveInt = 1
    dp_shard: int = -1
    tp: PositiveInt = 1
    ep: PositiveInt = 1
    """Expert parallelism (Mixture-of-Experts models): the experts are split over `ep` ranks,
    each holding num_experts / ep of them, and tokens travel to their experts' ranks and back
    by all-to-all. The ep ranks are a sub-axis of dp_shard (as in torchtitan): ep must divide
    dp_shard (resolved) and the model's num_experts; FSDP2 shards each rank's experts over the
    dp_shard / ep ranks that hold the same ones (HSDP: replicated over dp_replicate), everything
    else over all dp ranks as before.
    Not yet with tp > 1, compile, cpu_offload or LoRA. Allowed: a positive integer dividing
    dp_shard and num_experts."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    """torch.compile each transformer block."""
    float8: bool = False
    """Float8 linear layers through torchao (GPUs with float8 support only)."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer states."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 under bf16 compute (train.mixed_precision): the dtype gradients are reduce-scattered
    and summed in. bfloat16 sends half the bytes; the sums over ranks keep bf16's 8 bits.
    Allowed: "float32", "bfloat16"."""
    reshard_after_forward: bool | Literal["auto"] = "auto"
    """FSDP2: free each block's gathered weights after its forward (true: gathered again for
    backward) or keep them until backward (false: less communication, more memory). "auto":
    false on CUDA when the planner (`lmforge plan`) puts the job that way within 85% of the
    GPU's memory, else true; true on the CPU. Allowed: true, false, "auto"."""

    @field_validator("reshard_after_forward", mode="before")
    @classmethod
    def _check_reshard(cls, value):
        if not (isinstance(value, bool) or value == "auto"):
            raise ValueError('must be true, false or "auto"')
        return value

    @model_validator(mode="after")
    def _check_shard(self):
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError("dp_shard must be -1 (the rest of the world) or >= 1")
        return self
