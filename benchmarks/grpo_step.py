"""One GRPO step on one GPU (or the CPU), timed part by part, beside the engine's own batched
`generate` on the same model and batch (docs/grpo.md, issue 44's item 10).

The model is a preset with random weights (bf16 on a GPU, fp32 on the CPU) and the prompts are
random token ids, so no tokenizer is read; every completion runs to --new-tokens (no stop
token), so both sides generate the same number of tokens. The reward is the share of even token
ids in a completion, so a group's rewards differ and none is dropped.

Rows (one JSON object, also printed):
  generate        `Generator.generate` (compiled with CUDA graphs on a GPU: what `lmforge
                  generate` runs), prompts × G sequences at once, tokens/s
  rollout         `Rollouts` as `lmforge grpo` runs it: weight sync (engine set-up over the
                  policy's own weights), sampling, scoring, old log-probabilities, then the
                  update (forward + backward of the micro-batches, AdamW step)
  ratio           rollout tokens/s / generate tokens/s (the issue's target: >= 0.9)

    PYTHONPATH=$PWD python benchmarks/grpo_step.py --preset tiny --device cpu --prompts 4 \\
        --generations 4 --new-tokens 16 --prompt-len 16
    PYTHONPATH=$PWD python benchmarks/grpo_step.py --preset 1b --prompts 64 --generations 8 \\
        --new-tokens 256 --prompt-len 128
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks.common import PRESETS, cleanup, write_json
from lmforge.api import build_model
from lmforge.data.prompts import PromptLoader, PromptSample
from lmforge.generate import Generator, SamplingParams
from lmforge.models.llama import get_preset
from lmforge.train.config import GRPOSection
from lmforge.train.grpo_loss import GRPOLossStep
from lmforge.train.replica import FusedReplica
from lmforge.train.rewards import Reward
from lmforge.train.rollout import Rollouts


def random_prompt_ids(count: int, length: int, vocab: int) -> list[np.ndarray]:
    """The benchmark's prompts: `count` rows of `length` random token ids (also TRL's, in
    benchmarks/trl_grpo.py)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, length, dtype=np.int64) for _ in range(count)]


def word_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` whose token i is the word "t{i}" (every id decodes; a prompt of
    n words is n tokens): benchmarks/trl_grpo.py's and grpo_cli.py's, over a whole vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    return tokenizer


SIZES = ("prompts", "generations", "prompt_len", "new_tokens")  # a result's "sizes"


def shape_parser(doc: str, *, steps: str) -> argparse.ArgumentParser:
    """The arguments of the GRPO benchmarks (this one, grpo_cli.py, trl_grpo.py): the model, the
    device, the step's shapes and how many steps (`steps`: their help)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help=steps)
    return parser


def _prompts(args, vocab: int) -> list[PromptSample]:
    ids = random_prompt_ids(args.prompts, args.prompt_len, vocab)
    return [PromptSample(row, where=f"random:{i}") for i, row in enumerate(ids)]


def _even_tokens_reward() -> Reward:
    """The share of even token ids: a group's rewards differ (random weights, sampled)."""
    return Reward(
        name="even_tokens",
        weight=1.0,
        checks_correctness=False,
        score_fn=lambda c: sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1),
        description="'even_tokens'",
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def profiled(path: Path | None, device: torch.device):
    """torch.profiler over the block, its op table (by device time on a GPU) written to `path`
    (None: not profiled)."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as profiler:
        yield
        _sync(device)
    by = "device_time_total" if on_cuda else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profiler.key_averages().table(sort_by=by, row_limit=40))


def time_generate(model, prompts, args, device) -> dict:
    """The engine's own batched generate over every sequence of the rollout batch."""
    generator = Generator(
        model, max_batch=len(prompts) * args.generations, max_seq_len=args.seq_len, device=device
    )
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=())
    batch = [p.prompt_ids.tolist() for p in prompts for _ in range(args.generations)]
    generator.generate(batch[: len(batch)], params, seed=0)  # warm-up: compiles, records graphs
    _sync(device)
    start = time.perf_counter()
    out = generator.generate(batch, params, seed=1)
    _sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in out.results)
    with profiled(args.profile and args.profile / "profile_generate.txt", device):
        generator.generate(batch, params, seed=2)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def time_grpo_steps(model, prompts, args, device) -> list[dict]:
    """GRPO steps as `lmforge grpo` takes them (no checkpoints, no logging): rollout metrics
    from `Rollouts`, the update timed here."""
    grpo = GRPOSection(
        share_prompts=args.share_prompts,
        prompts_per_step=args.prompts,
        num_generations=args.generations,
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        logprob_gap=args.logprob_gap,
    )
    sequences = args.prompts * args.generations
    num_micro = -(-sequences // args.micro_batch_size)
    loader = PromptLoader(prompts, micro_batch_size=args.prompts, max_seq_len=args.seq_len)
    rollouts = Rollouts(
        prompts=loader,
        tokenizer=None,
        rewards=[_even_tokens_reward()],
        grpo=grpo,
        micro_batch_size=args.micro_batch_size,
        num_micro_batches=num_micro,
        max_seq_len=args.seq_len,
        pad_id=0,
        device=device,
        bf16=device.type == "cuda",  # under autocast, as `lmforge grpo` on a GPU
        seed=0,
    )
    loss_step = GRPOLossStep(clip_low=0.2, clip_high=0.28, beta=0.0, temperature=1.0)
    replica = FusedReplica(model, model.args, device) if args.fuse_rollouts else None
    rollouts.bind(model, reference=None, base=False, replica=replica, loss_step=loss_step)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    rows = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        batches = [{k: v.to(device) for k, v in next(rollouts).items()} for _ in range(num_micro)]
        _sync(device)
        update_start = time.perf_counter()
        total = sum(b["token_weights"].sum() for b in batches).clamp(min=1)
        for batch in batches:
            (loss_step(model, batch).loss_sum / total).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        end = time.perf_counter()
        row = {**rollouts.metrics, "update_s": end - update_start, "step_s": end - start}
        gap = loss_step.take_logprob_gap()  # μ = 1: measured in the update's forward
        rows.append(row if gap is None else {**row, "logprob_gap": gap})
    with profiled(args.profile and args.profile / "profile_rollout.txt", device):
        for _ in range(num_micro):  # one more rollout batch (the update not profiled)
            next(rollouts)
    return rows


def main() -> None:
    parser = shape_parser(__doc__, steps="GRPO steps (the first warms up)")
    parser.add_argument("--no-logprob-gap", dest="logprob_gap", action="store_false")
    parser.add_argument("--out", default=None, help="also write grpo_step.json here")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after the timed runs, profile one more generate and one more rollout batch: op "
        "tables in DIR/profile_generate.txt and profile_rollout.txt",
    )
    parser.add_argument(
        "--fuse-rollouts",
        action="store_true",
        help="sample from fused q/k/v and gate/up copies (grpo.fuse_rollouts)",
    )
    parser.add_argument(
        "--share-prompts",
        action="store_true",
        help="a group's prompt once a row in the update (grpo.share_prompts)",
    )
    args = parser.parse_args()
    args.seq_len = args.prompt_len + args.new_tokens
    device = torch.device(args.device)
    model_args = get_preset(PRESETS[args.preset]).replace(max_seq_len=max(args.seq_len, 256))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prompts = _prompts(args, model_args.vocab_size)

    model = build_model(model_args, seed=0).to(device=device, dtype=dtype)
    generate = time_generate(model, prompts, args, device)
    del model
    cleanup()
    model = build_model(model_args, seed=0).to(device=device, dtype=dtype).train()
    steps = time_grpo_steps(model, prompts, args, device)
    last = steps[-1]
    result = {
        "preset": args.preset,
        "device": str(device),
        "sizes": {k: getattr(args, k) for k in SIZES},
        "fuse_rollouts": args.fuse_rollouts,
        "share_prompts": args.share_prompts,
        "generate": generate,
        "grpo_steps": steps,
        "rollout_vs_generate": last["rollout_tokens_per_s"] / generate["tokens_per_s"],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        options = args.fuse_rollouts or args.share_prompts
        write_json(args.out, "grpo_step_options.json" if options else "grpo_step.json", result)


if __name__ == "__main__":
    main()
