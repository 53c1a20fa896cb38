"""lmforge eval: our lm-eval adapter against lm-eval's own `hf` backend on the same artifact,
results files and tables, task errors, perplexity."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch.nn.functional as F

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from lmforge import cli  # noqa: E402
from lmforge.api import build_model, load, save_state  # noqa: E402
from lmforge.artifact import artifact_hash  # noqa: E402
from lmforge.errors import ConfigError, DataError  # noqa: E402
from lmforge.eval import (  # noqa: E402
    LmforgeLM,
    format_comparison_table,
    perplexity,
    run_eval,
    write_demo_task,
)
from lmforge.eval.harness import metric_rows  # noqa: E402
from lmforge.eval.perplexity import sliding_windows  # noqa: E402
from tests.train_utils import demo_world, small_qwen3_args  # noqa: E402

# Sums of ~20 float32 log-probabilities of ~-5.7 each agree to a few float32 ulps, not to 1e-5
# absolute; relative 1e-6 is ~8 ulps.
LL_TOLERANCE = dict(rel=1e-6, abs=1e-5)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    data, tokenizer, args = demo_world(root, vocab_size=300)
    qwen3_args = small_qwen3_args(tokenizer.vocab_size)
    artifacts = []
    for seed, name, shape in ((0, "base", args), (1, "sft", args), (2, "qwen3", qwen3_args)):
        model = build_model(shape, seed=seed)
        with torch.no_grad():  # larger weights than init: less uniform, more telling scores
            for param in model.parameters():
                param.mul_(4.0)
        save_state(model.state_dict(), shape, tokenizer, root / name, stage="test", parent=None)
        artifacts.append(root / name)
    include = write_demo_task(data["mc_heldout"], root / "tasks")
    return {"root": root, "data": data, "artifacts": artifacts, "include": include}


@pytest.fixture(scope="module")
def without_bos(world):
    """The base artifact with a tokenizer.json that does not add BOS in transformers (as some
    Hugging Face Llama directories ship): lm-eval's `hf` backend then scores without it."""
    import shutil

    from tokenizers import Tokenizer, processors

    target = world["root"] / "base-no-bos"
    shutil.copytree(world["artifacts"][0], target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.save(str(target / "tokenizer.json"))
    assert not load(target).tokenizer.adds_bos and load(world["artifacts"][0]).tokenizer.adds_bos
    return target


def _hf_model_args(directory) -> str:
    return f"pretrained={directory},dtype=float32"  # the hf backend's own BOS default


@pytest.mark.parametrize(
    "task,chat,bos,index",
    [
        ("demo_mc", False, True, 0),
        ("demo_mc_chat", True, True, 0),
        ("demo_mc", False, False, 0),
        ("demo_mc", False, True, 2),
    ],
    ids=["plain", "chat", "tokenizer-without-bos", "qwen3"],
)
def test_multiple_choice_equals_hf_backend(world, request, task, chat, bos, index):
    """Per request, every log-likelihood equals the `hf` backend's, both with its defaults."""
    artifact = world["artifacts"][index] if bos else request.getfixturevalue("without_bos")
    ours = run_eval(
        [artifact],
        [task],
        include_path=world["include"],
        limit=10,
        batch_size=7,
        apply_chat_template=chat,
        log_samples=True,
        write=False,
    )[0].results
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=_hf_model_args(artifact),
        tasks=[task],
        task_manager=TaskManager(include_path=str(world["include"]), include_defaults=False),
        limit=10,
        batch_size=3,
        device="cpu",
        apply_chat_template=chat,
        log_samples=True,
    )
    for metric in ("acc,none", "acc_norm,none", "acc_stderr,none"):
        assert ours["results"][task][metric] == pytest.approx(
            theirs["results"][task][metric], abs=1e-12
        )
    our_samples, their_samples = ours["samples"][task], theirs["samples"][task]
    assert len(our_samples) == len(their_samples) == 10
    scores = []
    for mine, reference in zip(our_samples, their_samples):
        assert [tuple(a) for a in mine["arguments"]] == [tuple(a) for a in reference["arguments"]]
        for (ll, greedy), (ref_ll, ref_greedy) in zip(
            (r[0] for r in mine["resps"]), (r[0] for r in reference["resps"])
        ):
            assert ll == pytest.approx(ref_ll, **LL_TOLERANCE)
            assert greedy == ref_greedy
            scores.append(ll)
    assert len(set(scores)) > len(scores) // 2  # the choices really are scored differently
    if chat:  # the prompt is the chat-rendered question, the choice follows with no space
        context, continuation = our_samples[0]["arguments"][0]
        assert context.startswith("<|begin_of_text|><|start_header_id|>user")
        assert context.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert not continuation.startswith(" ")


def test_rolling_and_generation_equal_hf_backend(world):
    artifact = world["artifacts"][0]
    text = world["data"]["corpus"].read_text()[:1500]
    rolling = [
        Instance("loglikelihood_rolling", {}, (t,), i)
        for i, t in enumerate([text, text[:200], "Kelmora"])
    ]
    ours = LmforgeLM(artifact, max_length=48, batch_size=4)
    hf = HFLM(
        pretrained=str(artifact),
        dtype="float32",
        device="cpu",
        max_length=48,
        batch_size=4,
        add_bos_token=False,  # hf then scores from the prefix token without scoring BOS
    )
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(
        hf.loglikelihood_rolling(rolling), **LL_TOLERANCE
    )

    settings = {"until": ["lives"], "max_gen_toks": 10, "do_sample": False}
    prompts = ["Question: Where does Tamimo live?\nAnswer:", "Kelmora is", "A"]
    generate = [
        Instance("generate_until", {}, (p, dict(settings)), i) for i, p in enumerate(prompts)
    ]
    hf = HFLM(pretrained=str(artifact), dtype="float32", device="cpu", batch_size=2)
    ours = LmforgeLM(artifact, batch_size=2)
    assert ours.generate_until(generate) == hf.generate_until(generate)


def test_cli_results_json_comparison_and_perplexity(world, capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # not a git checkout: lm-eval's `git describe` says nothing
    base, sft = world["artifacts"][:2]
    held_out = world["root"] / "heldout.txt"
    held_out.write_text(world["data"]["corpus"].read_text()[:600])
    code = cli.main(
        [
            "eval",
            str(base),
            str(sft),
            "--tasks",
            "demo_mc",
            "--demo-data",
            str(world["data"]["mc_heldout"]),
            "--limit",
            "6",
            "--device",
            "cpu",
            "--batch-size",
            "8",
            "--perplexity",
            str(held_out),
            "--seq-len",
            "32",
            "--offline",
        ]
    )
    out, err = capfd.readouterr()
    assert code == 0 and "fatal" not in err, err
    files = [sorted((a / "eval").glob("results-*.json")) for a in (base, sft)]
    assert all(len(f) == 1 for f in files)
    results = [json.loads(f[0].read_text()) for f in files]
    for artifact, result in zip((base, sft), results):
        assert result["lmforge"]["model"]["hash"] == artifact_hash(artifact)
        assert result["n-samples"]["demo_mc"]["effective"] == 6
        assert 0.0 <= result["results"]["demo_mc"]["acc,none"] <= 1.0
    assert "== comparison" in out and "Δ sft - base" in out

    from lmforge.eval import EvalResult

    table = format_comparison_table(
        [EvalResult(str(base), results[0]), EvalResult(str(sft), results[1])]
    )
    row = next(
        line for line in table.splitlines() if line.startswith("demo_mc") and " acc " in line
    )
    (v0, e0), (v1, e1) = (metric_rows(r)[("demo_mc", "acc")] for r in results)
    assert f"{v0:.4f} ± {e0:.4f}" in row and f"{v1:.4f} ± {e1:.4f}" in row
    assert f"{v1 - v0:+.4f} ± {math.hypot(e0, e1):.4f}" in row
    assert row in out

    report = json.loads(next((base / "eval").glob("perplexity-*.json")).read_text())
    assert report["seq_len"] == 32 and report["stride"] == 16
    assert f"perplexity {report['perplexity']:.4f}" in out


def test_task_errors_name_the_task(world, tmp_path, capsys):
    artifact = world["artifacts"][0]
    with pytest.raises(ConfigError, match="unknown task 'no_such_task_xyz'"):
        run_eval([artifact], ["no_such_task_xyz"], include_path=world["include"], write=False)
    # Offline (conftest sets HF_DATASETS_OFFLINE) a hub task whose dataset is not cached.
    with pytest.raises(DataError, match=r"task 'hellaswag'.*dataset_path: json"):
        # (the same include path: lm-eval's task index, seconds to build, is made once)
        run_eval([artifact], ["hellaswag"], include_path=world["include"], write=False)
    # A local task whose data file is gone.
    include = write_demo_task(world["data"]["mc_heldout"], tmp_path / "tasks")
    (include / "demo_mc.yaml").write_text(
        (include / "demo_mc.yaml")
        .read_text()
        .replace(str(world["data"]["mc_heldout"]), str(tmp_path / "gone.jsonl"))
    )
    with pytest.raises(DataError, match="task 'demo_mc'"):
        run_eval([artifact], ["demo_mc"], include_path=include, write=False)
    # A missing model is named before any task is looked up.
    assert cli.main(["eval", str(tmp_path / "no_model"), "--tasks", "no_such_task_xyz"]) == 2
    assert f"{tmp_path / 'no_model'}: no such file or directory" in capsys.readouterr().err


def test_sliding_windows_score_every_token_once():
    for num_tokens, seq_len, stride in [(100, 16, 16), (100, 16, 5), (10, 32, 8), (17, 16, 1)]:
        scored = []
        for start, end, count in sliding_windows(num_tokens, seq_len, stride):
            assert end - 1 - start <= seq_len and 0 < count <= end - 1 - start
            scored += range(end - count, end)
        assert scored == list(range(1, num_tokens))


def test_perplexity_equals_direct_nll(world, tmp_path):
    artifact = world["artifacts"][1]
    loaded = load(artifact)
    text_file = tmp_path / "heldout.txt"
    text_file.write_text(world["data"]["corpus"].read_text()[:400])
    tokens = [loaded.tokenizer.bos_id, *loaded.tokenizer.encode(text_file.read_text())]
    ids = torch.tensor([tokens])

    with torch.no_grad():  # one window holds the whole text
        nll = F.cross_entropy(loaded.model(ids[:, :-1])[0].float(), ids[0, 1:])
    report = perplexity(loaded, [text_file], seq_len=len(tokens), stride=len(tokens))
    assert report["num_tokens"] == len(tokens) - 1
    assert report["perplexity"] == pytest.approx(math.exp(nll.item()), rel=1e-5)

    seq_len, total = 16, 0.0  # disjoint windows: each chunk sees only its own window
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, seq_len):
            window = ids[:, start : start + seq_len + 1]
            logits = loaded.model(window[:, :-1])[0].float()
            total += F.cross_entropy(logits, window[0, 1:], reduction="sum").item()
    report = perplexity(loaded, [text_file], seq_len=seq_len, stride=seq_len, batch_size=3)
    assert report["perplexity"] == pytest.approx(math.exp(total / (len(tokens) - 1)), rel=1e-5)

    with pytest.raises(ConfigError, match="stride"):
        perplexity(loaded, [text_file], seq_len=8, stride=9)
    with pytest.raises(DataError, match="no such file"):
        perplexity(loaded, [tmp_path / "missing.txt"], seq_len=8)


def test_preference_margins_equal_the_full_forward(world):
    """The preference evaluator scores responses with the shared scorer; its margins equal
    log-probabilities summed from a plain full forward over the labelled positions."""
    from lmforge.data.preference import PreferenceDataSection, load_preference_data
    from lmforge.eval.preference import preference_accuracy

    artifact, data_file = world["artifacts"][0], world["data"]["dpo_heldout"]
    result = preference_accuracy(artifact, data_file, batch_size=3, max_seq_len=64)
    loaded = load(artifact)
    pairs = load_preference_data(
        PreferenceDataSection(path=[str(data_file)], max_seq_len=64), loaded.tokenizer
    ).samples

    def full(inputs, labels) -> float:
        with torch.no_grad():
            logits = loaded.model(torch.as_tensor(inputs)[None]).log_softmax(-1)[0]
        return sum(logits[p, t].item() for p, t in enumerate(labels) if t >= 0)

    margins = [
        full(p.chosen_inputs, p.chosen_labels) - full(p.rejected_inputs, p.rejected_labels)
        for p in pairs
    ]
    assert result["num_pairs"] == len(pairs)
    assert result["mean_margin"] == pytest.approx(sum(margins) / len(margins), rel=1e-5)
    assert result["accuracy"] == sum(m > 0 for m in margins) / len(margins)


def test_padded_scoring_batches_give_the_same_scores(world):
    """Small scoring batches are padded to a power-of-two batch and a width bucket (on CUDA
    replayed as CUDA graphs; here eagerly): every sequence's log-probability and greedy flag
    are those of the unpadded batch; a batch past 1,024 padded tokens runs as it is."""
    from lmforge.generate import logprobs as scoring

    lm = LmforgeLM(world["artifacts"][0], batch_size=3)
    generator = torch.Generator().manual_seed(1)
    sequences = []
    for length in (2, 9, 17, 5, 30, 12, 400):  # the 400-token one: 4 x 512 > 1,024
        tokens = torch.randint(3, 300, (length,), generator=generator).tolist()
        sequences.append((tokens, min(4, length - 1)))
    plain = scoring.sequence_logprobs(lm.model, sequences, batch_size=3, device="cpu", graphs=False)
    padded = scoring.sequence_logprobs(lm.model, sequences, batch_size=3, device="cpu", graphs=True)
    for (a, greedy_a), (b, greedy_b) in zip(padded, plain):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
    # Longest first: 400, 30, 17 (4 x 512 padded: as it is), then 12, 9, 5 and 2 alone.
    assert sorted(scoring._FORWARDS[lm.model].buffers) == [(1, 16), (4, 16)]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_scoring_in_batches_with_progress_equals_one_call(world, capsys, monkeypatch):
    """Progress moves between batches, yet the batches are those one `sequence_logprobs`
    call makes, so the scores are equal to the bit; off a terminal the progress is plain
    lines, on one a tqdm bar."""
    import lmforge.progress
    from lmforge.generate.logprobs import sequence_logprobs

    monkeypatch.setattr(lmforge.progress, "PLAIN_EVERY_S", 0.0)
    lm = LmforgeLM(world["artifacts"][0], batch_size=3)
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for index in range(11):  # mixed lengths, ties, and unscored (n = 0) sequences
        length = int(torch.randint(2, 20, (1,), generator=generator))
        tokens = torch.randint(3, 300, (length,), generator=generator).tolist()
        sequences.append((tokens, 0 if index % 5 == 0 else min(3, length - 1)))
    expected = sequence_logprobs(lm.model, sequences, batch_size=3, device=lm.device)
    assert lm._score(sequences, desc="loglikelihood", disable=False) == expected
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("loglikelihood: 11/11 requests (100%), 0:")
    assert len(lines) == 1 + 3 + 1  # the unscored ones, 3 whole batches, the end

    terminal = _Terminal()
    with lmforge.progress.Progress(4, "loglikelihood", unit="requests", file=terminal) as bar:
        bar.update(4)
    assert "\r" in terminal.getvalue() and "4/4" in terminal.getvalue()
    assert lm._score(sequences, desc="loglikelihood", disable=True) == expected
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss"])
def test_shared_contexts_score_as_each_sequence_alone(family):
    """Multiple-choice requests sharing their question run as one row (the context once, each
    choice after it under a mask): the same log-likelihoods and greedy flags as scoring each
    sequence whole, for choices of different lengths, one-token ones, a context with one
    choice and unscored sequences; Llama, Qwen3 (head norms) and gpt-oss (sinks, a window
    shorter than the rows)."""
    from lmforge.api import build_model
    from lmforge.generate.logprobs import sequence_logprobs, shared_context_logprobs
    from tests.train_utils import small_args, small_qwen3_args

    if family == "gpt_oss":
        from lmforge import models

        args = models.get_preset("gpt-oss-20b").replace(
            dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=32,
            num_experts=4, num_experts_per_tok=2, vocab_size=300, sliding_window=6,
        )  # fmt: skip
    else:
        args = (small_qwen3_args if family == "qwen3" else small_args)(300)
    model = build_model(args, seed=3).eval()
    generator = torch.Generator().manual_seed(1)

    def draw(length: int) -> list[int]:
        return torch.randint(3, 300, (length,), generator=generator).tolist()

    sequences = []
    for question in range(5):
        context = draw(4 + 3 * question)
        for choice in range(4 if question != 2 else 1):
            continuation = draw(1 + (choice + question) % 3)
            sequences.append((context + continuation, len(continuation)))
    sequences.append((draw(6), 0))
    alone = sequence_logprobs(model, sequences, batch_size=4, device="cpu")
    shared = shared_context_logprobs(model, sequences, batch_size=2, device="cpu")
    for (a, greedy_a), (b, greedy_b) in zip(shared, alone, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
