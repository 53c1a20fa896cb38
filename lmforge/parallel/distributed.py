"""Process layout: the process group, the device, and the device mesh from the config's degrees.

Processes are started by torchrun (locally, under Slurm or Kubernetes); torch.distributed reads
the rendezvous from torchrun's environment. One process without torchrun is the degenerate case:
no process group, no mesh.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.errors import ConfigError
from lmforge.parallel.config import ParallelSection

MESH_AXES = ("dp_replicate", "dp_shard", "tp")
# Expert parallelism's view of the same ranks: ep is the inner (contiguous) part of dp_shard.
SPARSE_AXES = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")


@dataclass
class Layout:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None  # axes MESH_AXES, or None for one process
    dp_rank: int
    dp_size: int
    tp_size: int
    dp_group: object = None  # process group over (dp_replicate, dp_shard); None: one process
    ep_size: int = 1
    # axes SPARSE_AXES: dp_shard split into (dp_shard_mod_ep, ep); None unless ep_size > 1
    sparse_mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The (dp_replicate, dp_shard) sub-mesh FSDP2 shards over (HSDP when both > 1)."""
        return None if self.mesh is None else self.mesh["dp_replicate", "dp_shard"]

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh the experts are split over (all-to-all of tokens); None without ep."""
        return None if self.sparse_mesh is None else self.sparse_mesh["ep"]

    @property
    def expert_dp_mesh(self) -> DeviceMesh | None:
        """The (dp_replicate, dp_shard_mod_ep) mesh FSDP2 shards each rank's experts over."""
        if self.sparse_mesh is None:
            return None
        return self.sparse_mesh["dp_replicate", "dp_shard_mod_ep"]


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            'train.device = "cuda" but no CUDA device is available; allowed here: cpu, auto'
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def mesh_shape(parallel: ParallelSection, world_size: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp), with dp_shard=-1 resolved; checked against world_size."""
    replicate, shard, tp = parallel.dp_replicate, parallel.dp_shard, parallel.tp
    if shard == -1:
        if world_size % (replicate * tp):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.dp_replicate ({replicate}) "
                f"× parallel.tp ({tp}) = {replicate * tp}"
            )
        shard = world_size // (replicate * tp)
    if replicate * shard * tp != world_size:
        raise ConfigError(
            f"parallel.dp_replicate ({replicate}) × parallel.dp_shard ({shard}) × parallel.tp "
            f"({tp}) = {replicate * shard * tp} does not match the world size {world_size} "
            "(number of processes)"
        )
    check_ep(parallel, shard)
    return replicate, shard, tp


def check_ep(parallel: ParallelSection, dp_shard: int) -> None:
    """parallel.ep against the resolved dp_shard and the options it does not combine with yet."""
    ep = parallel.ep
    if ep == 1:
        return
    if dp_shard % ep:
        allowed = [d for d in range(1, dp_shard + 1) if dp_shard % d == 0]
        raise ConfigError(
            f"parallel.ep = {ep} must divide parallel.dp_shard ({dp_shard}: the expert-parallel "
            f"ranks are a part of the data-parallel shards); allowed here: {allowed}"
        )
    for key, value, off in (
        ("parallel.tp", parallel.tp, 1),
        ("parallel.compile", parallel.compile, False),
        ("parallel.cpu_offload", parallel.cpu_offload, False),
    ):
        if value != off:
            raise ConfigError(
                f"parallel.ep = {ep} cannot be combined with {key} = {str(value).lower()} yet; "
                f"set {key} = {str(off).lower()} or parallel.ep = 1"
            )


def setup(parallel: ParallelSection, device_choice: str) -> Layout:
    """Initialize the process group (when under torchrun) and build the mesh."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    shape = mesh_shape(parallel, world_size)
    if world_size == 1:
        return Layout(
            rank=0, world_size=1, device=device, mesh=None, dp_rank=0, dp_size=1, tp_size=1
        )
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_AXES)
    replicate_rank = mesh.get_local_rank("dp_replicate")
    shard_rank = mesh.get_local_rank("dp_shard")
    sparse_mesh = None
    if parallel.ep > 1:
        sparse_mesh = mesh._unflatten(
            "dp_shard", (shape[1] // parallel.ep, parallel.ep), SPARSE_AXES[1:3]
        )
    return Layout(
        rank=dist.get_rank(),
        world_size=world_size,
        device=device,
        mesh=mesh,
        dp_rank=replicate_rank * shape[1] + shard_rank,
        dp_size=shape[0] * shape[1],
        tp_size=shape[2],
        dp_group=mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group(),
        ep_size=parallel.ep,
        sparse_mesh=sparse_mesh,
    )


def teardown(*, wait_for_all: bool = False) -> None:
    """Destroy the process group; with `wait_for_all` (every rank is known to get here) after a
    barrier, so no rank tears its group down while a peer is still using it: a gloo rank that
    did so ahead of the others was seen to abort at exit (SIGABRT after its last step)."""
    if dist.is_initialized():
        if wait_for_all and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
