"""The reference for lmforge's MoE training row: torchtitan 0.2.2's own Qwen3-MoE (its
`qwen3_args["30B-A3B"]` cut to --num-layers blocks: dim 2048, 32 heads, 4 kv heads, head_dim
128, 128 experts top-8 of width 768, vocab 151936) through its `parallelize_qwen3` on one GPU,
trained as torchtitan's trainer trains it there: fp32 weights under bf16 autocast, its
cross-entropy (sum, divided by the step's tokens), gradient clipping at 1.0, fused AdamW with
its auxiliary-loss-free expert-bias update (`build_optimizers_with_moe_load_balancing`),
random tokens. Prints one JSON line: tokens/s and MFU on the active parameters' FLOPs, counted
as `ModelArgs.flops_per_token` counts lmforge's side (6 x active matmul parameters without the
input lookup + 12 x layers x heads x head_dim x seq_len), so the two rows compare.

`bash benchmarks/device_calls.sh moe-train` runs it beside benchmarks/train_throughput.py in one
call (torchtitan's wheels from .whl/). On a CPU (no CUDA) it runs a debug shape in eager with the
experts' loop: torchtitan's grouped path pads the groups with a Triton kernel.

    torchrun --nproc_per_node 1 benchmarks/titan_moe.py --num-layers 4 --batch 4 --seq 2048
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3, qwen3_args

PEAK_FLOPS = 989e12  # H100 / H200 SXM dense bf16, as benchmarks/train_throughput.py


def model_args(num_layers: int, seq: int, debug: bool):
    """Qwen3-30B-A3B's shapes with `num_layers` blocks; `debug`: a small shape for the CPU."""
    args = copy.deepcopy(qwen3_args["30B-A3B"])  # update_from_config writes into it
    args.n_layers, args.max_seq_len = num_layers, seq
    if debug:
        args.dim, args.n_heads, args.n_kv_heads, args.head_dim = 64, 4, 2, 16
        args.vocab_size, args.moe_inter_dim = 512, 32
        args.moe_args.num_experts, args.moe_args.top_k = 8, 2
        args.moe_args.use_grouped_mm = False
    return args


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ac", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    else:  # the router counts with torch.histc on int64, which only CUDA has: a float copy here
        histc = torch.histc
        torch.histc = lambda x, *rest, **kw: histc(x.float(), *rest, **kw).to(x.dtype)
    compile_ = cuda and not args.no_compile  # the CPU's debug run: eager

    job = JobConfig()
    job.compile.enable = compile_  # components: model and loss
    job.activation_checkpoint.mode = args.ac
    job.training.seq_len = args.seq
    job.optimizer.implementation = "fused" if cuda else "foreach"
    margs = model_args(args.num_layers, args.seq, debug=not cuda)
    margs.update_from_config(job)
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1
    )
    with torch.device("meta"):
        model = Qwen3Model(margs)
    model = parallelize_qwen3(model, parallel_dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    optimizers = build_optimizers_with_moe_load_balancing([model], job.optimizer, parallel_dims)
    loss_fn = build_cross_entropy_loss(job)

    # Active matmul parameters: all but the input lookup and the unchosen experts' share.
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if "moe.experts" in n)
    moe = margs.moe_args
    active = (
        params
        - model.tok_embeddings.weight.numel()
        - experts * (moe.num_experts - moe.top_k) // moe.num_experts
    )
    attention = 12 * margs.n_layers * margs.n_heads * margs.head_dim * args.seq
    flops_per_token = 6 * active + attention

    generator = torch.Generator(device=device).manual_seed(0)

    def step() -> None:
        tokens = torch.randint(
            0, margs.vocab_size, (args.batch, args.seq + 1), device=device, generator=generator
        )
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        optimizers.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):  # maybe_enable_amp on one GPU
            pred = model(inputs)
            loss = loss_fn(pred, labels) / labels.numel()
        del pred
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), job.training.max_norm, foreach=True)
        optimizers.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    tokens_per_s = args.batch * args.seq / seconds
    row = {
        "engine": "torchtitan-0.2.2",
        "model": f"qwen3-30b-a3b x{margs.n_layers} layers" + ("" if cuda else " (debug shape)"),
        "batch": args.batch,
        "seq": args.seq,
        "compile": compile_,
        "ac": args.ac,
        "params": params,
        "active_params": active,
        "flops_per_token": flops_per_token,
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(tokens_per_s * flops_per_token / PEAK_FLOPS, 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None,
        "step_s": round(seconds, 4),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
    }
    print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "titan_moe.json").write_text(json.dumps(row, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
