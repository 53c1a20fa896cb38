"""The output projection and its cross entropy, forward and backward, on one GPU: logits then
the compiled cross entropy (lmforge before the fused loss) against `output_cross_entropy`
(the gradient made in the forward, `lmforge/modules/cross_entropy.py`), and the fused row
kernel alone for a few warp counts.

    python benchmarks/output_loss.py --tokens 16384 --dim 2048 --vocab 128256
"""

from __future__ import annotations

import argparse

import torch
import triton

from lmforge.data.sft import IGNORE_INDEX
from lmforge.modules import cross_entropy
from lmforge.train.losses import token_cross_entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda"
    output = torch.nn.Linear(args.dim, args.vocab, bias=False, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16)
    hidden.requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device)
    labels[::7] = IGNORE_INDEX
    compiled = torch.compile(token_cross_entropy)

    def apart():
        loss = compiled(output(hidden)[None], labels[None])
        (loss / args.tokens).backward()

    def fused():
        loss = cross_entropy.output_cross_entropy(hidden, output, labels)
        (loss / args.tokens).backward()

    logits = output(hidden).detach()
    losses = torch.empty(args.tokens, device=device)

    def rows(warps: int, block: int):
        return lambda: cross_entropy.cross_entropy_rows(
            logits, labels, losses, write_grad=True, warps=warps, block=block
        )

    gb = logits.numel() * logits.element_size() / 1e9
    results = {
        "logits + compiled cross entropy, fwd+bwd": triton.testing.do_bench(apart),
        "fused, fwd+bwd": triton.testing.do_bench(fused),
        "the matmul alone (logits)": triton.testing.do_bench(lambda: output(hidden)),
    }
    for warps in (8, 16, 32):
        for block in (4096, 8192, 16384):
            name = f"row kernel alone, {warps} warps, block {block}"
            results[name] = triton.testing.do_bench(rows(warps, block))
    print(f"tokens {args.tokens}, dim {args.dim}, vocab {args.vocab}: logits {gb:.2f} GB (bf16)")
    for name, ms in results.items():
        extra = f"  ({2 * gb / ms:.2f} TB/s at one read + one write)" if "row" in name else ""
        print(f"{name:60s} {ms:8.3f} ms{extra}")


if __name__ == "__main__":
    main()
