"""TRL's GRPOTrainer on the shapes of benchmarks/grpo_step.py, seconds a step (issue 44's item 10:
lmforge's GRPO step against TRL's on the same model, batch and lengths).

The model is the preset's architecture in transformers (random weights, bf16 on a GPU), the
prompts the same random token ids as grpo_step.py's, written as words of a word-level tokenizer
over the whole vocabulary ("t0" .. "t{vocab-1}", so every id decodes and a prompt is exactly
--prompt-len tokens), and the reward the same share of even token ids. TRL samples with
transformers' `generate` (its default when vLLM is not installed; `--continuous-batching`:
transformers' continuous batching). One optimizer step a generation batch: prompts ×
generations completions, --micro-batch-size a forward, as grpo_step.py's step; loss "dapo"
(token-level), clip 0.2 / 0.28, beta 0, AdamW at lr 1e-6.

    PYTHONPATH=$PWD python benchmarks/trl_grpo.py --preset tiny --device cpu --prompts 4 \\
        --generations 4 --new-tokens 16 --prompt-len 16 --micro-batch-size 8
    PYTHONPATH=$PWD python benchmarks/trl_grpo.py --preset 1b --prompts 64 --generations 8 \\
        --new-tokens 256 --prompt-len 128
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks.common import PRESETS, write_json
from benchmarks.grpo_step import SIZES, random_prompt_ids, shape_parser, word_tokenizer
from lmforge.models import args_to_hf_config
from lmforge.models.llama import get_preset


def hf_word_tokenizer(vocab_size: int):
    """grpo_step.py's word-level tokenizer as transformers takes it."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=word_tokenizer(vocab_size),
        pad_token="t0",
        eos_token=f"t{vocab_size - 1}",
        unk_token="t0",
    )


def even_tokens(completions, completion_ids, **_) -> list[float]:
    """grpo_step.py's reward: the share of even token ids in a completion."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def hf_model(args, device: torch.device):
    import transformers

    model_args = get_preset(PRESETS[args.preset]).replace(max_seq_len=max(args.seq_len, 256))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = args_to_hf_config(model_args, dtype)
    config = transformers.CONFIG_MAPPING[config["model_type"]](**config)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, model_args.vocab_size


class StepTimer:
    """Seconds of each optimizer step (a transformers TrainerCallback, made in `main`)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self._start = device, [], 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_step_begin(self, *_, **__) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_step_end(self, *_, **__) -> None:
        self._sync()
        self.seconds.append(time.perf_counter() - self._start)


def main() -> None:
    parser = shape_parser(__doc__, steps="optimizer steps (the first warms up)")
    parser.add_argument("--continuous-batching", action="store_true")
    parser.add_argument("--out", default=None, help="also write trl_grpo.json here")
    args = parser.parse_args()
    args.seq_len = args.prompt_len + args.new_tokens

    import datasets
    import transformers
    import trl

    device = torch.device(args.device)
    model, vocab = hf_model(args, device)
    tokenizer = hf_word_tokenizer(vocab)
    rows = args.prompts * args.steps
    ids = random_prompt_ids(rows, args.prompt_len, vocab)
    data = datasets.Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in row) for row in ids]})
    sequences = args.prompts * args.generations
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"),
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=sequences // args.micro_batch_size,
        num_generations=args.generations,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        learning_rate=1e-6,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        bf16=device.type == "cuda",
        use_cpu=device.type == "cpu",
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_transformers_continuous_batching=args.continuous_batching,
        dataloader_num_workers=0,
    )
    timer = StepTimer(device)
    callback = type("Timer", (transformers.TrainerCallback,), {})()
    callback.on_step_begin, callback.on_step_end = timer.on_step_begin, timer.on_step_end
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=even_tokens,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    result = {
        "preset": args.preset,
        "device": str(device),
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "generation": "continuous batching" if args.continuous_batching else "generate",
        "sizes": {k: getattr(args, k) for k in SIZES},
        "step_s": timer.seconds,
        "completion_len": [entry.get("completions/mean_length") for entry in logs],
        "reward": [entry.get("reward") for entry in logs],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, "trl_grpo.json", result)


if __name__ == "__main__":
    main()
