"""torchrun worker for tests/test_checkpoint.py: a tiny Llama under FSDP2 (gloo, CPU).

`checkpoint_worker.py RUN_DIR --marker FILE [--steps N] [--async-save] [--dump-full]`:
restore the newest checkpoint of RUN_DIR and check that it is exactly what was saved (a
checksum of every parameter and optimizer shard, recorded in the checkpoint itself, and the
per-rank loader state), write MARKER (JSON: restored step, ok), then train N steps and save
after every one. The test SIGKILLs it at random moments. With --dump-full, the full
(unsharded) model and optimizer state after the last step go to RUN_DIR/full.pt, for the
test's 1-process reshard load to compare against.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from lmforge.models.llama import Transformer, get_preset
from lmforge.train.checkpoint import Checkpointer, ModelOptimizerState, RNGState

# A large vocabulary makes each checkpoint ~50 MB (embedding + output, with AdamW's two
# moments), so a save takes long enough to be hit by a kill; compute stays small.
MODEL_ARGS = get_preset("tiny").replace(
    dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128, vocab_size=32768
)


class CounterLoader:
    """Stand-in data loader: its state is per rank (which rank, how many batches)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.position = rank, 0
        self.resharded_from: int | None = None

    def state_dict(self) -> dict:
        return {"rank": self.rank, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.rank, self.position = state["rank"], state["position"]

    def load_resharded_state_dict(self, state: dict, *, saved_world_size: int) -> None:
        self.position, self.resharded_from = state["position"], saved_world_size


def build_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(MODEL_ARGS)
    model.init_weights()
    return model


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    tokens = torch.randint(0, MODEL_ARGS.vocab_size, (2, 33))  # global RNG: per-rank stream
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def checksum(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Sum of every parameter and optimizer-state shard over all ranks, in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        for tensor in (param, *optimizer.state.get(param, {}).values()):
            total += (tensor.to_local() if hasattr(tensor, "to_local") else tensor).double().sum()
    dist.all_reduce(total)
    return total.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--dump-full", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")

    model = build_model()
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    optimizer = build_optimizer(model)  # after sharding: it must hold the DTensor parameters
    torch.manual_seed(1 + rank)  # per-rank data stream, carried over by RNGState
    loader, progress = CounterLoader(rank), {"step": 0, "checksum": 0.0}
    state = {
        "model": ModelOptimizerState(model, optimizer),
        "rng": RNGState(),
        "dataloader": loader,
        "train": progress,
    }
    checkpointer = Checkpointer(args.run_dir, keep_last=2, async_save=args.async_save)
    restored = checkpointer.restore_latest(state)
    ok = restored is None or (
        progress["step"] == restored == loader.position
        and loader.rank == rank
        and checksum(model, optimizer) == progress["checksum"]
    )
    flag = torch.tensor(int(ok))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:  # written whole, then renamed: the test may kill us right after
        partial = Path(args.marker + ".partial")
        partial.write_text(json.dumps({"restored": restored, "ok": bool(flag)}))
        partial.rename(args.marker)
    if not flag:
        raise SystemExit(3)

    start = restored or 0
    for step in range(start + 1, start + args.steps + 1):
        train_step(model, optimizer)
        loader.position += 1
        progress.update(step=step, checksum=checksum(model, optimizer))
        checkpointer.save(step, state)
    checkpointer.close()
    if args.dump_full:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=full)
        if rank == 0:
            torch.save({"model": model_sd, "optimizer": optim_sd}, Path(args.run_dir) / "full.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
