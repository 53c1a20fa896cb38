"""The reference for lmforge's MoE LoRA row: transformers 5's Qwen3MoeForCausalLM with PEFT's
LoRA, one training step as a transformers + PEFT SFT script runs it, on the shapes of
`train_throughput.py --shapes moe:4x2048 --num-layers 4 --variants ours-lora-compile`.

The model is built from lmforge's `qwen3-30b-a3b` preset through `args_to_hf_config` (dim 2048,
32 heads, 4 kv heads, head_dim 128, 128 experts top-8 of width 768, vocab 151936), cut to
--num-layers blocks, random weights in bf16, its experts through transformers'
`experts_implementation="grouped_mm"` (one `grouped_mm` a projection over the stacked
experts; asked for by name, so a transformers without it fails instead of looping) and SDPA
attention. PEFT's LoRA: rank 16, alpha 32 (lmforge's 2 x rank), on q/k/v/o_proj and, through
`target_parameters`, on `mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (what lmforge's
default targets mean on a MoE; PEFT's adapters in fp32, as its `autocast_adapter_dtype`
keeps them). The step: bf16 autocast, the model's own loss with labels (cross-entropy plus
`router_aux_loss_coef` x its load-balancing loss, `output_router_logits` on as lmforge's row
adds its aux loss), gradient clipping at 1.0, fused AdamW (lr 1e-4, weight decay 0.1), random
tokens. --compile: `torch.compile` on each decoder layer (PEFT applies an expert adapter by
registering a parametrization each forward, a new class each time: dynamo breaks its graphs
there and, past its recompile limit, runs those frames eagerly; the rest stays compiled).

Prints one JSON line (tokens/s, step seconds, trainable parameters, peak memory, versions);
writes hf_peft_moe[-compile].json under --out.

    PYTHONPATH=$PWD python benchmarks/hf_peft_moe.py --tiny              # the CPU's check
    PYTHONPATH=$PWD python benchmarks/hf_peft_moe.py --num-layers 4 --batch 4 --seq 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from benchmarks import common
from lmforge.models import args_to_hf_config, get_preset

# A small Qwen3-MoE for the CPU (the shape train_throughput.py's CPU check takes with --override).
TINY = {"dim": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "ffn_dim": 128,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_ffn_dim": 32, "vocab_size": 256,
        "bos_id": 0, "eos_id": 1}  # fmt: skip
ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def build(args, device: torch.device):
    """The PEFT model (LoRA on attention and the experts) and its config's model args."""
    import transformers
    from peft import LoraConfig, get_peft_model

    margs = get_preset(common.PRESETS["moe"]).replace(
        num_layers=args.num_layers, **(TINY if args.tiny else {})
    )
    config = transformers.Qwen3MoeConfig(**args_to_hf_config(margs, torch.bfloat16))
    config.output_router_logits = True  # the aux loss in the step's loss, as lmforge's row
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM._from_config(
            config,
            dtype=torch.bfloat16,
            attn_implementation="sdpa",
            experts_implementation=args.experts,
        )
    lora = LoraConfig(
        r=common.LORA_RANK,
        lora_alpha=2 * common.LORA_RANK,
        lora_dropout=0.0,
        target_modules=ATTENTION_TARGETS,
        target_parameters=EXPERT_TARGETS,
    )
    model = get_peft_model(model, lora)
    model.train()
    return model, margs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument(
        "--experts", default="grouped_mm", help="transformers' experts_implementation"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a small shape (and batch 2 x 32) for the CPU"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 32)
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    import peft
    import transformers

    model, margs = build(args, device)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    expert_adapters = [n for n in trainable if ".mlp.experts." in n]
    if not expert_adapters:
        raise SystemExit(f"PEFT put no adapter on the experts: trainable {list(trainable)[:8]}")
    if args.compile:
        for layer in model.base_model.model.model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(
        trainable.values(), lr=1e-4, weight_decay=0.1, fused=cuda, foreach=None if cuda else True
    )
    batches = common.random_batches(margs.vocab_size, args.batch, args.seq, device)

    def steps(count: int) -> tuple[float, torch.Tensor]:
        """Seconds for `count` training steps (to the GPU's last kernel) and the last loss."""
        start = time.perf_counter()
        for _ in range(count):
            batch = next(batches)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=batch["inputs"], labels=batch["inputs"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable.values(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, loss.detach()

    warmup_s, _ = steps(args.warmup)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, loss = steps(args.steps)
    seconds /= args.steps
    row = {
        "engine": f"transformers-{transformers.__version__}+peft-{peft.__version__}",
        "model": f"qwen3-30b-a3b x{margs.num_layers} layers" + (" (tiny)" if args.tiny else ""),
        "experts_implementation": model.config._experts_implementation,
        "attn_implementation": model.config._attn_implementation,
        "compile": args.compile,
        "batch": args.batch,
        "seq": args.seq,
        "lora_rank": common.LORA_RANK,
        "trainable_params": sum(p.numel() for p in trainable.values()),
        "expert_adapter_params": sum(trainable[n].numel() for n in expert_adapters),
        "tokens_per_s": round(args.batch * args.seq / seconds),
        "step_s": round(seconds, 4),
        "warmup_s": round(warmup_s, 1),
        "loss": round(float(loss), 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
    }
    if args.tiny:  # what the CPU check looks at: the adapters PEFT put on the experts
        row["expert_adapters"] = expert_adapters[:4]
    print(json.dumps(row), flush=True)
    name = "hf_peft_moe" + ("-compile" if args.compile else "") + ".json"
    common.write_json(args.out, name, row)


if __name__ == "__main__":
    main()
