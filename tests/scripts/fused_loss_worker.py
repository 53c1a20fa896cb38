"""One of two gloo processes (torchrun): the fused output loss and the AdamW kernel under FSDP2,
against the logits apart and torch's AdamW, on a model with tied and one with untied embeddings.
The kernels run under Triton's interpreter (TRITON_INTERPRET=1, from the test's environment);
the fused path is taken as on a GPU. Rank 0 prints "fused loss ok" when every rank agrees."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from lmforge.models.llama import Transformer, get_preset
from lmforge.modules import cross_entropy
from lmforge.train.adamw import AdamW
from lmforge.train.losses import CausalLMLoss

ARGS = get_preset("tiny").replace(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96)


def sharded_model(tied: bool) -> Transformer:
    torch.manual_seed(0)  # the same weights on every rank
    model = Transformer(ARGS.replace(tie_embeddings=tied, vocab_size=300))
    model.init_weights()
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    return model


def gradients(model: Transformer, fused: bool, batch: dict) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    out = CausalLMLoss(fused=fused)(model, batch)
    (out.loss_sum / 16).backward()
    loss = out.loss_sum.detach().clone()
    dist.all_reduce(loss)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return loss.item(), grads


def check(tied: bool, rank: int) -> bool:
    model = sharded_model(tied)
    generator = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
    tokens = torch.randint(0, 300, (2, 9), generator=generator)
    batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
    batch["labels"][0, :3] = -100
    fused_loss, fused_grads = gradients(model, True, batch)
    loss, grads = gradients(model, False, batch)
    ok = abs(fused_loss - loss) <= 1e-4 * abs(loss)
    ok &= all(torch.allclose(fused_grads[n], grads[n], rtol=1e-4, atol=1e-6) for n in grads)
    # One AdamW step on the sharded parameters: the kernel against torch's.
    model, reference = sharded_model(tied), sharded_model(tied)  # fresh, alike
    ours, theirs = AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters())
    theirs.param_groups[0]["lr"] = 1e-2
    for optimizer, net in ((ours, model), (theirs, reference)):
        net.zero_grad(set_to_none=True)
        (CausalLMLoss(fused=False)(net, batch).loss_sum / 16).backward()
        optimizer.step()
    for mine, other in zip(model.parameters(), reference.parameters()):
        ok &= torch.allclose(mine.full_tensor(), other.full_tensor(), rtol=1e-5, atol=1e-6)
    return bool(ok and ours.kernel)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # As on a GPU: the kernel serves any plain output projection (here on the CPU).
    cross_entropy.fusable = lambda hidden, output: (
        cross_entropy.fusable_output(output)
        and (type(output.weight) in (torch.Tensor, torch.nn.Parameter))
    )
    flag = torch.tensor(int(check(tied=True, rank=rank) and check(tied=False, rank=rank)))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if rank == 0:
        print("fused loss ok" if flag else "fused loss DIFFERS", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
