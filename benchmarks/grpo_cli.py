"""`lmforge grpo` itself on the shapes of benchmarks/grpo_step.py: the step as a user runs it
(the one training loop, its optimizer, autocast and logging), its times from the run's
metrics.jsonl, and its peak memory beside what `lmforge plan` says of the same job.

The artifact is the preset with random weights (bf16) and a word-level tokenizer over the whole
vocabulary (token i is the word "t{i}", so every sampled id decodes and a prompt of
--prompt-len words is that many tokens); the prompts are grpo_step.py's random ids as words; the
reward (a Python file) is the share of words "t{even}" in a completion, grpo_step.py's even-ids
share. Every optimizer step is one rollout batch (μ = 1).

    PYTHONPATH=$PWD python benchmarks/grpo_cli.py --preset tiny --device cpu --prompts 4 \\
        --generations 4 --new-tokens 16 --prompt-len 16 --micro-batch-size 8
    PYTHONPATH=$PWD python benchmarks/grpo_cli.py --preset 1b --prompts 64 --generations 8 \\
        --new-tokens 256 --prompt-len 128
    # two GPUs (`lmforge launch --nproc 2`), tensor parallel; JSON in grpo_cli-tp2.json
    PYTHONPATH=$PWD python benchmarks/grpo_cli.py --preset 1b --nproc 2 --tag tp2 parallel.tp=2
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks.common import PRESETS, write_json
from benchmarks.grpo_step import SIZES, random_prompt_ids, shape_parser, word_tokenizer
from benchmarks.multi_gpu import GIB, planned

ROOT = Path(__file__).resolve().parents[1]

REWARD = '''
def even_words(text, sample):
    """The share of words "t<even number>" in the completion."""
    words = text.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(len(words), 1)
'''

KEYS = ("weight_sync_s", "rollout_s", "rollout_tokens_per_s", "scoring_s", "logprob_s",
        "update_s", "rollout_total_s", "logprob_gap", "completion_len", "reward")  # fmt: skip


def make_artifact(preset: str, root: Path) -> Path:
    import lmforge
    from lmforge.api import LoadedModel, build_model
    from lmforge.data.tokenizer import HFTokenizer
    from lmforge.models.llama import get_preset

    args = get_preset(PRESETS[preset])
    model = build_model(args, dtype=torch.bfloat16, seed=0)
    tokenizer = HFTokenizer(word_tokenizer(args.vocab_size), config={"eos_token": "t1"})
    loaded = LoadedModel(model=model, tokenizer=tokenizer, config=args, source=preset)
    return lmforge.save(loaded, root / "artifact")


def main() -> None:
    parser = shape_parser(__doc__, steps="GRPO steps (the first compiles)")
    parser.add_argument("--out", default=None, help="also write grpo_cli[-TAG].json here")
    parser.add_argument("--tag", default="", help="names the JSON: grpo_cli-TAG.json")
    parser.add_argument("--nproc", type=int, default=1, help="processes (lmforge launch)")
    parser.add_argument("overrides", nargs="*", help="more KEY=VALUE for `lmforge grpo`")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="grpo_cli_"))
    artifact = make_artifact(args.preset, root)
    vocab = json.loads((artifact / "config.json").read_text())["vocab_size"]
    prompts = root / "prompts.jsonl"
    ids = random_prompt_ids(args.prompts, args.prompt_len, vocab)
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{i}" for i in row)}) + "\n"
                               for row in ids))  # fmt: skip
    reward = root / "reward.py"
    reward.write_text(REWARD)
    launch = ["launch", "--nproc", str(args.nproc)] if args.nproc > 1 else []
    command = [sys.executable, "-m", "lmforge", *launch, "grpo", f"run_dir={root / 'run'}",
        f"model.source={artifact}", f"data.path={prompts}",
        f"data.max_seq_len={args.prompt_len + args.new_tokens}",
        f"train.steps={args.steps}", f"train.micro_batch_size={args.micro_batch_size}",
        f"train.device={args.device}", "optim.lr=1e-6", "scheduler.warmup_steps=0",
        "metrics.log_every=1", "metrics.tensorboard=false", "checkpoint.every=0",
        f"grpo.prompts_per_step={args.prompts}", f"grpo.num_generations={args.generations}",
        f"grpo.max_new_tokens={args.new_tokens}", "grpo.temperature=1.0", "grpo.clip_high=0.28",
        f'grpo.rewards=[{{kind = "python", function = "{reward}:even_words"}}]',
        *args.overrides]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=sys.stderr)  # stdout: the JSON alone
    seconds = time.perf_counter() - start
    records = [
        json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps, seen = [], 0
    for record in (r for r in records if "rollout_s" in r):  # one a step (log_every 1)
        # the step's time: its input tokens over the loop's tokens/s since the last log
        step_s = (record["tokens_seen"] - seen) / record["tokens_per_s"]
        seen = record["tokens_seen"]
        steps.append({**{k: record[k] for k in KEYS if k in record}, "step_s": step_s})
    result = {
        "preset": args.preset,
        "device": args.device,
        "sizes": {k: getattr(args, k) for k in SIZES},
        "processes": args.nproc,
        "overrides": args.overrides,
        "command_s": seconds,
        "steps": steps,
        # the run's peak (max allocated: rollouts and updates) beside `lmforge plan` of its job
        "peak_gib": max(r.get("peak_mem_gb", 0.0) for r in records) * 1e9 / GIB,
        **planned(root / "run", args.nproc),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, f"grpo_cli{'-' + args.tag if args.tag else ''}.json", result)


if __name__ == "__main__":
    main()
