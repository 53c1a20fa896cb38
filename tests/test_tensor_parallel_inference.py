"""Tensor-parallel inference on 2 gloo processes (`lmforge launch --nproc 2 generate|eval`):
the same greedy tokens as one process, tied and untied embeddings, Qwen3, Qwen3-MoE (its
attention split, its experts split by expert) and gpt-oss (its sinks and biases too), and the same per-request
log-likelihoods under lm-eval (within 1e-4)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import lmforge
from lmforge.api import LoadedModel, build_model
from lmforge.eval import run_eval, write_demo_task
from lmforge.models import get_preset
from tests.train_utils import demo_world, small_qwen3_args, small_qwen3_moe_args

PROMPTS = ["the cat sat", "a b c d e f g h", "x"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    data, tokenizer, args = demo_world(root, vocab_size=300)
    artifacts = {}
    shapes = {False: args, True: args.replace(tie_embeddings=True)}
    shapes["qwen3"] = small_qwen3_args(tokenizer.vocab_size)  # tied, q/k head norms
    # Mixture-of-Experts: attention split over the processes, the experts 2 of 4 a process
    shapes["qwen3_moe"] = small_qwen3_moe_args(tokenizer.vocab_size)
    # gpt-oss: biased projections (wo's bias added once), sinks split by head, a window of 4
    shapes["gpt_oss"] = get_preset("gpt-oss-20b").replace(
        dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=32,
        num_experts=4, num_experts_per_tok=2, sliding_window=4, vocab_size=tokenizer.vocab_size,
        bos_id=None, eos_id=None,
    )  # fmt: skip
    for tied, model_args in shapes.items():
        model = build_model(model_args, seed=5).eval()
        with torch.no_grad():  # peakier distributions: greedy choices far from ties
            for param in model.parameters():
                param.mul_(3.0)
        loaded = LoadedModel(model=model, tokenizer=tokenizer, config=model_args, source="t")
        artifacts[tied] = lmforge.save(loaded, root / f"tied-{tied}")
    include = write_demo_task(data["mc_heldout"], root / "tasks")
    return {"root": root, "artifacts": artifacts, "include": include}


def _lmforge(*argv: str, nproc: int = 1) -> str:
    launch = ["launch", "--nproc", str(nproc)] if nproc > 1 else []
    command = [sys.executable, "-m", "lmforge", *launch, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _texts_and_counts(stdout: str) -> str:
    """The generated texts and per-prompt token counts, without the timing report."""
    return stdout.split("\ntime:")[0]


@pytest.mark.parametrize(
    "tied",
    [False, True, "qwen3", "qwen3_moe", "gpt_oss"],
    ids=["untied", "tied", "qwen3", "qwen3_moe", "gpt_oss"],
)
def test_generate_tp2_equals_one_process(world, tied):
    argv = ["generate", str(world["artifacts"][tied]), "--prompt", *PROMPTS]
    argv += ["--temperature", "0", "--max-new-tokens", "16", "--max-batch", "2"]
    one = _lmforge(*argv)
    two = _lmforge(*argv, nproc=2)
    assert re.search(r"\[3\] \d+ prompt tokens, \d+ new", one)
    assert _texts_and_counts(two) == _texts_and_counts(one)
    # the report's peak is the largest of the processes, each one's follows
    peak = re.search(r"peak memory: ([\d.]+ [kMG]B) \(CPU max RSS; per process: (.+), (.+)\)", two)
    assert peak and peak[1] in (peak[2], peak[3]), two
    assert "per process" not in one


def test_generate_tp2_with_an_adapter_equals_one_process(world, tmp_path):
    """`--lora` under tensor parallelism (Qwen3, tied): each process holds its share of the
    adapter (B's rows of q/k/v/gate/up, A's columns of o/down, the rank-r products summed);
    the greedy tokens are one process's, and the adapter changes them."""
    from tests.test_adapters import make_adapter

    artifact = world["artifacts"]["qwen3"]
    base = lmforge.load(artifact).model
    targets = ["q", "k", "v", "o", "gate", "up", "down"]
    make_adapter(base, tmp_path / "adapter", targets=targets, rank=4, seed=7, std=0.5)
    argv = ["generate", str(artifact), "--prompt", *PROMPTS, "--temperature", "0"]
    argv += ["--max-new-tokens", "12", "--max-batch", "2"]
    plain = _lmforge(*argv)
    one = _lmforge(*argv, "--lora", str(tmp_path / "adapter"))
    two = _lmforge(*argv, "--lora", str(tmp_path / "adapter"), nproc=2)
    assert _texts_and_counts(two) == _texts_and_counts(one) != _texts_and_counts(plain)


def test_eval_tp2_loglikelihoods_equal_one_process(world):
    artifact = world["artifacts"][True]
    out = world["root"] / "eval-tp2"
    argv = ["eval", str(artifact), "--tasks", "demo_mc", "--include-path", str(world["include"])]
    argv += ["--limit", "6", "--log-samples", "--out", str(out), "--batch-size", "4"]
    _lmforge(*argv, nproc=2)
    (written,) = out.glob("*.json")  # rank 0 alone writes
    theirs = json.loads(written.read_text())
    ours = run_eval(
        [artifact],
        ["demo_mc"],
        include_path=world["include"],
        limit=6,
        batch_size=4,
        log_samples=True,
        write=False,
    )[0].results
    pairs = zip(ours["samples"]["demo_mc"], theirs["samples"]["demo_mc"], strict=True)
    count = 0
    for mine, split in pairs:
        for (ll, greedy), (tp_ll, tp_greedy) in zip(
            (r[0] for r in mine["resps"]), (r[0] for r in split["resps"]), strict=True
        ):
            assert abs(ll - tp_ll) <= 1e-4
            assert greedy == tp_greedy
            count += 1
    assert count >= 12
    runtime = theirs["lmforge"]["runtime"]  # the evaluation's seconds and every process's peak
    assert runtime["evaluate_s"] > 0 and len(runtime["process_peak_memory_bytes"]) == 2
    assert runtime["peak_memory_bytes"] == max(runtime["process_peak_memory_bytes"]) > 0
    assert ours["results"]["demo_mc"]["acc,none"] == theirs["results"]["demo_mc"]["acc,none"]


def test_serve_tp2_answers_as_one_process(world, tmp_path):
    """`lmforge launch --nproc 2 serve`: rank 0 serves HTTP, rank 1 replays its engine; greedy
    answers equal one process's `lmforge generate`, seeded sampling repeats, and SIGTERM ends
    both processes and the launch (128 + 15, without a traceback)."""
    import signal
    import time

    import openai

    artifact = world["artifacts"][True]
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "lmforge", "launch", "--nproc", "2", "serve", str(artifact)]
    command += [
        "--port",
        "0",
        "--device",
        "cpu",
        "--max-concurrency",
        "4",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (found := re.search(r"on (http://127\.0\.0\.1:\d+/v1)", log.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=found.group(1), api_key="none", max_retries=20)
        model = client.models.list().data[0].id
        greedy = [
            client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]
        sampled = [
            [c.text for c in client.completions.create(
                model=model, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=3, n=2
            ).choices]
            for _ in range(2)
        ]  # fmt: skip
        unseeded = client.completions.create(
            model=model,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=1.0,
            logprobs=0,
            n=3,
            extra_body={"return_tokens_as_token_ids": True},
        ).choices
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    # torchrun passed the signal on and waited for both processes; no traceback of its own
    assert process.returncode == 128 + signal.SIGTERM, log.read_text()
    assert "Traceback" not in log.read_text() and "stopped by SIGTERM" in log.read_text()
    argv = ["generate", str(artifact), "--prompt", *PROMPTS, "--temperature", "0"]
    one = _lmforge(*argv, "--max-new-tokens", "16")
    for prompt, text in zip(PROMPTS, greedy):
        assert f"=== {prompt}\n{text}\n" in one
    assert sampled[0] == sampled[1] and sampled[0][0] != sampled[0][1]
    _assert_drawn_alike(artifact, PROMPTS[1], unseeded)


def _assert_drawn_alike(artifact, prompt: str, choices) -> None:
    """Unseeded sampled rows draw from the engine's generator, which every process seeds
    alike: had rank 1 drawn other tokens, its half of each next token's embedding lookup would
    be another token's, and the log-probabilities rank 0 reported would not be those of one
    process reading rank 0's tokens (named by id: vLLM's `return_tokens_as_token_ids`)."""
    from lmforge.generate.logprobs import sequence_logprobs
    from lmforge.generate.sequence import encode_prompt

    loaded = lmforge.load(artifact)
    prompt_ids = encode_prompt(prompt, loaded.tokenizer, vocab_size=loaded.config.vocab_size)
    texts = set()
    for choice in choices:
        ids = [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]
        expected, _ = sequence_logprobs(
            loaded.model, [(prompt_ids + list(ids), len(ids))], batch_size=1, device="cpu"
        )[0]
        assert abs(sum(choice.logprobs.token_logprobs) - expected) < 1e-3, choice.text
        texts.add(choice.text)
    assert len(texts) > 1  # sampled, not greedy


def test_a_pipeline_eval_stage_runs_tensor_parallel(world, tmp_path):
    """`launcher.nproc_per_node = 2` on an eval stage: the pipeline runs its command under
    torchrun (2 gloo processes here) and the stage's results are one process's."""
    from lmforge.pipeline import load_pipeline, run_pipeline

    artifact = world["artifacts"][False]
    (tmp_path / "p.toml").write_text(
        '[pipeline]\nname = "p"\n[launcher]\nenv = { OMP_NUM_THREADS = "1" }\n'
        f'[stages.ev]\nkind = "eval"\nmodels = ["{artifact}"]\nlabels = ["m"]\n'
        f'tasks = ["demo_mc"]\ninclude_path = ["{world["include"]}"]\nlimit = 4\n'
        "batch_size = 4\nlauncher.nproc_per_node = 2\n"
    )
    pipeline = load_pipeline(tmp_path / "p.toml", workdir=tmp_path)
    assert pipeline.stages[0].distributed
    lines: list[str] = []
    assert run_pipeline(pipeline, echo=lines.append).ok, "\n".join(lines[-30:])
    stage_dir = tmp_path / "runs/p/ev"
    assert "--nproc-per-node=2" in (stage_dir / "command.sh").read_text()
    results = json.loads((stage_dir / "out/results.json").read_text())
    ours = run_eval([artifact], ["demo_mc"], include_path=world["include"], limit=4, write=False)
    accuracy = results["models"]["m"]["metrics"]
    assert ours[0].results["results"]["demo_mc"]["acc,none"] in accuracy.values(), accuracy
    # tensor-parallel inference runs on one node
    text = (tmp_path / "p.toml").read_text() + "launcher.nodes = 2\n"
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(lmforge.errors.ConfigError, match="runs on one node"):
        load_pipeline(tmp_path / "p.toml", workdir=tmp_path)


def test_launch_ends_with_exit_code_2_on_a_user_error(tmp_path):
    """A user error in the processes (a missing artifact) ends `lmforge launch` with 2 and the
    processes' own message, not torchrun's failure report."""
    command = [sys.executable, "-m", "lmforge", "launch", "--nproc", "2", "generate"]
    command += [str(tmp_path / "missing"), "--prompt", "hi"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "missing: no such file or directory" in done.stderr
    assert "stopped on the error above" in done.stderr and "Root Cause" not in done.stderr
