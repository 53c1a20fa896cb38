"""GRPO (`lmforge grpo`): prompt data, rewards, the loss against plain loops written here, and
rollouts on the one engine through the one loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import load_config
from lmforge.data.prompts import PromptDataSection, load_prompt_data
from lmforge.data.sft import IGNORE_INDEX
from lmforge.errors import ConfigError, DataError
from lmforge.train.config import GRPOJob
from lmforge.train.grpo_loss import (
    STD_EPS,
    GRPOLossStep,
    PickedLogProbs,
    group_advantages,
    grpo_token_losses,
    sequence_means,
    token_logps,
)
from lmforge.train.rewards import (
    Completion,
    RewardError,
    RewardSection,
    build_rewards,
    extract_number,
    normalize_text,
    overlong_penalty,
    score_completions,
)
from tests.train_utils import demo_world

# ---- config ---------------------------------------------------------------------------------


def test_one_step_trains_on_one_rollout_batch():
    job = load_config(GRPOJob, None, ["grpo.prompts_per_step=3", "grpo.num_generations=4"])
    assert job.train.global_batch_size == 12
    with pytest.raises(ConfigError, match=r"leave train\.global_batch_size unset"):
        load_config(GRPOJob, None, ["train.global_batch_size=8"])
    with pytest.raises(ConfigError, match="leaves no room for a prompt"):
        load_config(GRPOJob, None, ["data.max_seq_len=64", "grpo.max_new_tokens=64"])
    with pytest.raises(ConfigError, match="num_generations"):
        load_config(GRPOJob, None, ["grpo.num_generations=1"])
    with pytest.raises(ConfigError, match=r"set grpo\.eval_every \(and data\.heldout\)"):
        load_config(GRPOJob, None, ["train.eval_every=5"])
    with pytest.raises(ConfigError, match=r"grpo\.eval_every needs held-out prompts"):
        load_config(GRPOJob, None, ["grpo.eval_every=5"])


def test_reward_sections_check_their_settings(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[[grpo.rewards]]\nkind = "regex"\npattern = "("\n')
    with pytest.raises(ConfigError, match="not a regular expression"):
        load_config(GRPOJob, path)
    path.write_text('[[grpo.rewards]]\nkind = "python"\nfunction = "rewards.py"\n')
    with pytest.raises(ConfigError, match=r"path/to/file\.py:function_name"):
        load_config(GRPOJob, path)
    path.write_text('[[grpo.rewards]]\nkind = "numeric_match"\nweight = 2.0\n')
    job = load_config(GRPOJob, path)
    assert job.grpo.rewards[0].weight == 2.0 and job.grpo.rewards[0].field == "answer"
    yaml = tmp_path / "job.yaml"  # YAML and key=value overrides, as for sft and dpo
    yaml.write_text("grpo:\n  clip_high: 0.28\n  rewards:\n    - {kind: regex, pattern: 'x+'}\n")
    job = load_config(GRPOJob, yaml, ["grpo.num_generations=4", "grpo.scale_rewards=false"])
    assert (job.grpo.clip_high, job.grpo.num_generations, job.grpo.scale_rewards) == (
        0.28,
        4,
        False,
    )
    assert job.grpo.rewards[0].pattern == "x+"


# ---- prompt data ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The demo data and its BPE tokenizer (it has a Llama 3 chat template)."""
    paths, tokenizer, args = demo_world(tmp_path_factory.mktemp("grpo-world"), vocab_size=400)
    return paths, tokenizer, args


def _write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_rows_text_and_chat_keep_their_fields(tmp_path, world):
    _, tokenizer, _ = world
    rows = [
        {"prompt": "Where does Ada live?", "answer": "Paris"},
        {"messages": [{"role": "user", "content": "How old is Bo?"}], "answer": 7},
    ]
    cfg = PromptDataSection(path=[str(_write_rows(tmp_path / "p.jsonl", rows))])
    data = load_prompt_data(cfg, tokenizer, max_prompt_len=64)
    text, chat = data.samples
    assert text.prompt_ids.tolist() == tokenizer.encode("Where does Ada live?", bos=True)
    expected = tokenizer.encode_chat(rows[1]["messages"], add_generation_prompt=True)
    assert chat.prompt_ids.tolist() == expected
    assert text.fields["answer"] == "Paris" and chat.fields["answer"] == 7
    assert chat.where.endswith("p.jsonl:2")


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("{not json", "p.jsonl:2"),
        ({"question": "no prompt"}, "no 'prompt' (text) or 'messages' (chat) field"),
        ({"prompt": ""}, "must be non-empty text"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "ends with an assistant"),
        ({"prompt": "word " * 80}, "leave room for grpo.max_new_tokens"),
    ],
)
def test_bad_prompt_row_names_file_and_line(tmp_path, world, bad, reason):
    _, tokenizer, _ = world
    path = _write_rows(tmp_path / "p.jsonl", [{"prompt": "ok"}, bad])
    with pytest.raises(DataError, match=r"p\.jsonl:2") as err:
        load_prompt_data(PromptDataSection(path=[str(path)]), tokenizer, max_prompt_len=32)
    assert reason in str(err.value)


# ---- rewards --------------------------------------------------------------------------------


def _completion(text: str, num_tokens: int = 3, **sample) -> Completion:
    return Completion(text=text, num_tokens=num_tokens, sample=sample, where="rows.jsonl:7")


def test_answer_extraction_and_normalisation():
    assert normalize_text("  The  Answer: PARIS. ") == "the answer: paris"
    assert extract_number("so 3 + 4 = 7\n#### 1,234.5") == 1234.5
    assert extract_number("first 12 then \\boxed{\\frac{1}{2}} and 99") == 2.0  # last in box
    assert extract_number("\\boxed{-42} 17") == -42
    assert extract_number("a 1 b 2.5e1 c") == 25.0
    assert extract_number("no digits") is None
    assert overlong_penalty(10, max_tokens=20, buffer=8) == 0.0
    assert overlong_penalty(16, max_tokens=20, buffer=8) == -0.5
    assert overlong_penalty(25, max_tokens=20, buffer=8) == -1.0


def test_rewards_combine_with_weights_and_define_accuracy():
    sections = [
        RewardSection(kind="numeric_match", weight=1.0),
        RewardSection(kind="regex", pattern=r"^Answer:", weight=0.5, name="format"),
        RewardSection(kind="length_penalty", buffer=2, max_tokens=4, weight=2.0),
    ]
    rewards = build_rewards(sections, max_new_tokens=8)
    completions = [
        _completion("Answer: 7", num_tokens=2, answer="7"),
        _completion("it is 8", num_tokens=3, answer=7),
        _completion("Answer: 7 #### 7", num_tokens=6, answer="7"),
    ]
    scores = score_completions(rewards, completions)
    assert scores.by_reward == {
        "numeric_match": [1.0, 0.0, 1.0],
        "format": [1.0, 0.0, 1.0],
        "length_penalty": [0.0, -0.5, -1.0],
    }
    assert scores.total == [1.5, -1.0, -0.5]
    assert scores.correct == [True, False, True]
    exact = build_rewards([RewardSection(kind="exact_match")], max_new_tokens=8)
    assert score_completions(exact, [_completion(" paris!", answer="Paris")]).total == [1.0]
    with pytest.raises(RewardError, match=r"rows\.jsonl:7 has no field 'answer'"):
        score_completions(exact, [_completion("x", solution="y")])


def test_user_reward_function_is_loaded_from_its_file_only(tmp_path):
    code = tmp_path / "my_rewards.py"
    code.write_text(
        "def has_word(completion, sample):\n"
        "    return sample['word'] in completion\n"
        "def broken(completion, sample):\n"
        "    return 1 / 0\n"
        "def not_a_number(completion, sample):\n"
        "    return 'yes'\n"
    )
    (reward,) = build_rewards(
        [RewardSection(kind="python", function=f"{code}:has_word")], max_new_tokens=8
    )
    assert reward.name == "has_word"
    scores = score_completions(
        [reward], [_completion("a cat", word="cat"), _completion("dog", word="cat")]
    )
    assert scores.total == [1.0, 0.0] and scores.correct is None
    for name, message in [
        ("broken", "failed on sample rows.jsonl:7: ZeroDivisionError"),
        ("not_a_number", "returned 'yes' for sample rows.jsonl:7"),
    ]:
        (bad,) = build_rewards(
            [RewardSection(kind="python", function=f"{code}:{name}")], max_new_tokens=8
        )
        with pytest.raises(RewardError, match=message) as err:
            score_completions([bad], [_completion("x", word="cat")])
        assert f"{code}:{name}" in str(err.value)
    with pytest.raises(RewardError, match="defines no function 'missing'"):
        build_rewards([RewardSection(kind="python", function=f"{code}:missing")], max_new_tokens=8)
    with pytest.raises(RewardError, match="is not a file"):
        build_rewards(
            [RewardSection(kind="python", function=f"{tmp_path}/nope.py:f")], max_new_tokens=8
        )


# ---- the loss against plain loops -----------------------------------------------------------


def _reference_advantages(rewards: list[list[float]], scale: bool) -> list[list[float]]:
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out.append([(r - mean) / (std + STD_EPS) if scale else r - mean for r in group])
    return out


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_a_plain_loop(scale):
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.0, 3.0]]
    advantages, equal = group_advantages(torch.tensor(rewards), scale=scale)
    expected = _reference_advantages(rewards, scale)
    assert torch.allclose(advantages, torch.tensor(expected), atol=1e-6)
    assert equal.tolist() == [False, True, False]


def _reference_loss_and_grad(logps, old, adv, ref, weights, *, clip_low, clip_high, beta):
    """Σ weight · token loss and its gradient with respect to logps, one token at a time:
    d/dl of -min(ρA, clip(ρ)A) is -ρA where the unclipped term is the smaller (or they tie),
    else 0; d/dl of k3 = exp(r - l) - (r - l) - 1 is 1 - exp(r - l)."""
    total, grad = 0.0, [[0.0] * len(row) for row in logps]
    for i, row in enumerate(logps):
        for t, logp in enumerate(row):
            w = weights[i][t]
            if w == 0:
                continue
            ratio = math.exp(logp - old[i][t])
            unclipped = ratio * adv[i][t]
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high) * adv[i][t]
            loss = -min(unclipped, clipped)
            d = -ratio * adv[i][t] if unclipped <= clipped else 0.0
            if beta:
                diff = ref[i][t] - logp
                loss += beta * (math.exp(diff) - diff - 1)
                d += beta * (1 - math.exp(diff))
            total += w * loss
            grad[i][t] = w * d
    return total, grad


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_and_gradient_match_a_plain_loop(beta):
    generator = torch.Generator().manual_seed(0)
    old = (-torch.rand(3, 6, generator=generator) * 3).double()
    # ratios from 0.5 to 1.6: some inside the clip range, some beyond each side
    logps = old + torch.empty(3, 6).uniform_(-0.7, 0.5, generator=generator).double()
    ref = old + torch.randn(3, 6, generator=generator).double() * 0.3
    adv = torch.tensor([[1.5] * 6, [-0.8] * 6, [0.3] * 3 + [-1.2] * 3], dtype=torch.float64)
    weights = torch.tensor(
        [[1.0] * 6, [0.25] * 4 + [0.0] * 2, [0.0] + [1.0] * 5], dtype=torch.float64
    )
    logps.requires_grad_(True)
    losses, clipped, kl = grpo_token_losses(
        logps, old, adv, clip_low=0.2, clip_high=0.28, beta=beta, ref_logps=ref
    )
    total = (losses * weights).sum()
    total.backward()
    expected, expected_grad = _reference_loss_and_grad(
        logps.tolist(), old.tolist(), adv.tolist(), ref.tolist(), weights.tolist(),
        clip_low=0.2, clip_high=0.28, beta=beta,
    )  # fmt: skip
    assert math.isclose(total.item(), expected, rel_tol=1e-12)
    assert torch.allclose(logps.grad, torch.tensor(expected_grad, dtype=torch.float64), atol=1e-12)
    ratio = (logps - old).exp()
    assert clipped.any() and not clipped.all()  # the toy batch crosses both clip edges
    assert ((ratio > 1.28) & (adv > 0) | (ratio < 0.8) & (adv < 0)).double().equal(clipped)
    assert (kl.abs().sum() > 0) == bool(beta)


def test_sequence_ratios_match_a_plain_loop():
    """GSPO (grpo.importance_sampling = "sequence"): each completion's tokens share one ratio,
    exp of the mean of their log-ratios, clipped as a whole; the loss and its gradient equal a
    loop over the completions written here (two completions packed in the last row, positions
    of no completion between them)."""
    generator = torch.Generator().manual_seed(2)
    old = (-torch.rand(3, 6, generator=generator) * 3).double()
    logps = old + torch.empty(3, 6).uniform_(-0.01, 0.01, generator=generator).double()
    ids = torch.tensor([[0] * 6, [1] * 4 + [-1] * 2, [-1, 2, 2, -1, 3, 3]])
    advantages = torch.tensor([1.5, -0.8, 0.3, -1.2], dtype=torch.float64)
    adv = torch.where(ids >= 0, advantages[ids.clamp(min=0)], torch.zeros(()).double())
    weights = (ids >= 0).double()
    clip_low, clip_high = 3e-4, 4e-4
    logps.requires_grad_(True)
    losses, clipped, _ = grpo_token_losses(
        logps, old, adv, clip_low=clip_low, clip_high=clip_high, sequence_ids=ids
    )
    (losses * weights).sum().backward()
    expected, expected_grad = 0.0, torch.zeros(3, 6, dtype=torch.float64)
    ratios = []
    for sequence, a in enumerate(advantages.tolist()):
        at = [(i, t) for i in range(3) for t in range(6) if ids[i, t] == sequence]
        mean = sum(logps[i, t].item() - old[i, t].item() for i, t in at) / len(at)
        ratio = math.exp(mean)
        ratios.append(ratio)
        bounded = min(max(ratio, 1 - clip_low), 1 + clip_high)
        expected += len(at) * -min(ratio * a, bounded * a)  # each token counts it once
        if ratio * a <= bounded * a:  # unclipped: each of n tokens' -ρA, ρ = exp(Σ(l - old) / n)
            for i, t in at:
                expected_grad[i, t] = len(at) * -ratio * a / len(at)  # n terms, dρ/dl = ρ / n
    assert math.isclose((losses * weights).sum().item(), expected, rel_tol=1e-12)
    assert torch.allclose(logps.grad, expected_grad, atol=1e-12)
    tokens_clipped = [clipped[ids == j].unique().tolist() for j in range(4)]
    assert all(len(c) == 1 for c in tokens_clipped)  # a completion is clipped whole
    assert [c[0] for c in tokens_clipped] == [
        float((r > 1 + clip_high and a > 0) or (r < 1 - clip_low and a < 0))
        for r, a in zip(ratios, advantages.tolist(), strict=True)
    ]
    assert 0 < sum(c[0] for c in tokens_clipped) < 4  # some clipped, some not
    means = sequence_means(torch.arange(18.0).view(3, 6), ids)
    assert means[2].tolist() == [0.0, 13.5, 13.5, 0.0, 16.5, 16.5]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_picked_log_probs_in_chunks_equal_the_whole_log_softmax(dtype, monkeypatch):
    """`PickedLogProbs` (chunks of 3 rows here) gives log_softmax(logits / T) at the labels, the
    entropies and the gradient of the whole-vocabulary way, in the logits' dtype."""
    from lmforge.train import grpo_loss

    monkeypatch.setattr(grpo_loss, "CHUNK_VALUES", 3 * 50)
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(8, 50, generator=g) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 50, (8,), generator=g)
    weights = torch.randn(8, generator=g).double()
    picked, entropy = PickedLogProbs.apply(logits, labels, 0.7)
    (picked.double() * weights).sum().backward()
    whole = logits.detach().double().requires_grad_(True)
    log_probs = (whole / 0.7).log_softmax(dim=-1)
    want = log_probs.gather(-1, labels[:, None]).squeeze(-1)
    (want * weights).sum().backward()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert picked.dtype == entropy.dtype == torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(picked.double(), want.detach(), rtol=tol, atol=tol)
    entropies = -(log_probs.exp() * log_probs).sum(dim=-1)
    torch.testing.assert_close(entropy.double(), entropies.detach(), rtol=tol, atol=tol)
    assert logits.grad.dtype == dtype and not entropy.requires_grad
    torch.testing.assert_close(
        logits.grad.double(), whole.grad, rtol=1e-2 if dtype == torch.bfloat16 else 1e-10,
        atol=1e-2 * whole.grad.abs().max().item() if dtype == torch.bfloat16 else 1e-12,
    )  # fmt: skip


def test_loss_step_keeps_no_float32_vocabulary_rows_for_backward():
    """What the loss step's forward keeps for the backward: of [n, V] activations, only the
    logits themselves (the eager log-softmax kept an fp32 copy and its output)."""
    from lmforge.api import build_model
    from tests.train_utils import small_args

    vocab = 97  # (no other width of the model's tensors)
    model = build_model(small_args(vocab_size=vocab), seed=0).to(torch.bfloat16)
    inputs = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = torch.full((2, 9), IGNORE_INDEX)
    labels[:, 3:] = inputs[:, 3:]
    batch = {
        "inputs": inputs,
        "labels": labels,
        "advantages": torch.ones(2, 9),
        "token_weights": (labels != IGNORE_INDEX).float(),
    }
    kept, weights = [], {p.data_ptr() for p in model.parameters()}

    def keep(tensor):
        if tensor.data_ptr() not in weights:  # (the output weight's [dim, V] view apart)
            kept.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    step = GRPOLossStep(clip_low=0.2, clip_high=0.28, beta=0.0, temperature=1.0)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = step(model, batch)
    out.loss_sum.backward()
    vocabulary_rows = [(shape, dtype) for shape, dtype in kept if shape[-1:] == (vocab,)]
    assert vocabulary_rows == [((12, vocab), torch.bfloat16)]  # 2 rows x 6 completion tokens


def test_loss_step_aggregates_by_token_weights_on_a_model():
    """GRPOLossStep on a real model: sequence-level weights give the mean over completions of
    their token means, computed here sequence by sequence."""
    from lmforge.api import build_model
    from tests.train_utils import small_args

    model = build_model(small_args(vocab_size=64), seed=0).double()
    inputs = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = torch.full((2, 7), IGNORE_INDEX)
    labels[0, 2:6] = inputs[0, 3:7]  # sequence 0: 4 completion tokens
    labels[1, 4:7] = torch.tensor([5, 9, 11])  # sequence 1: 3
    lengths = [4, 3]
    weights = (labels != IGNORE_INDEX).double() / torch.tensor(lengths, dtype=torch.float64)[
        :, None
    ]
    with torch.no_grad():
        old = token_logps(model(inputs), labels, temperature=0.7) - 0.05
    advantages = torch.tensor([[0.9], [-1.1]], dtype=torch.float64).expand(2, 7)
    batch = {
        "inputs": inputs,
        "labels": labels,
        "old_logps": old,
        "advantages": advantages,
        "token_weights": weights,
    }
    step = GRPOLossStep(clip_low=0.2, clip_high=0.2, beta=0.0, temperature=0.7)
    out = step(model, batch)
    logits = model(inputs)
    expected = 0.0
    for row, length in enumerate(lengths):
        token_losses = []
        for t in range(7):
            if labels[row, t] == IGNORE_INDEX:
                continue
            logp = torch.log_softmax(logits[row, t] / 0.7, dim=-1)[labels[row, t]]
            ratio = torch.exp(logp - old[row, t])
            a = advantages[row, t]
            token_losses.append(-torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a))
        expected += sum(token_losses) / length
    assert torch.allclose(out.loss_sum, expected, atol=1e-10)
    assert math.isclose(out.num_tokens.item(), 2.0, rel_tol=1e-12)
    assert np.isclose(out.metrics["clip_fraction"].item(), 0.0)


def test_one_step_a_rollout_needs_no_old_logps_and_measures_the_engine_gap():
    """With μ = 1 the batch carries no old log-probabilities: the loss step takes its own,
    detached (ratio 1), which gives the loss and gradient of old log-probabilities from a
    separate forward of the same weights, and compares the engine's log-probabilities with its
    forward's (the largest gap, then forgotten)."""
    from lmforge.api import build_model
    from tests.train_utils import small_args

    model = build_model(small_args(vocab_size=64), seed=0).double()
    inputs = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    labels = torch.full((2, 7), IGNORE_INDEX)
    labels[0, 2:6], labels[1, 4:7] = inputs[0, 3:7], torch.tensor([5, 9, 11])
    batch = {
        "inputs": inputs,
        "labels": labels,
        "advantages": torch.tensor([[0.9], [-1.1]], dtype=torch.float64).expand(2, 7),
        "token_weights": (labels != IGNORE_INDEX).double(),
    }
    with torch.no_grad():
        logps = token_logps(model(inputs), labels)
    engine = logps.clone()
    engine[1, 5] += 0.25  # one token the engine scored 0.25 apart
    engine[0, 0] += 9.0  # not a completion token: not compared
    step = GRPOLossStep(clip_low=0.2, clip_high=0.28, beta=0.0, temperature=1.0)
    grads = []
    for extra in ({"engine_logps": engine}, {"old_logps": logps}):
        model.zero_grad()
        out = step(model, {**batch, **extra})
        out.loss_sum.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        if "engine_logps" in extra:
            loss = out.loss_sum.item()
            assert step.take_logprob_gap() == pytest.approx(0.25, abs=1e-9)
            assert step.take_logprob_gap() is None
        else:
            assert out.loss_sum.item() == pytest.approx(loss, abs=1e-12)
    torch.testing.assert_close(grads[0], grads[1])


# ---- the stage: rollouts on the engine, through the CLI -------------------------------------

# A reward a tiny random model learns in a few steps: the share of the letter "e" in its text.
# GRPO_TEST_REWARD_SLEEP slows a run down (not its values) so a test can kill it mid-way.
REWARD_CODE = """
import os, time

def letter_e(completion, sample):
    time.sleep(float(os.environ.get("GRPO_TEST_REWARD_SLEEP", "0")))
    return completion.count("e") / max(len(completion), 1)
"""


def _grpo_world(root: Path, family: str = "llama", **shape):
    """A small random base artifact (SMALL_SHAPE, or with `shape`'s changes; Llama untied, or
    Qwen3 tied) with the demo tokenizer, demo prompts with answers, and the reward file."""
    from lmforge.api import build_model, save_state
    from tests.train_utils import small_family_args

    paths, tokenizer, _ = demo_world(root, vocab_size=400)
    if family == "llama":
        shape = {"tie_embeddings": False, **shape}
    args = small_family_args(family, tokenizer.vocab_size, **shape)
    base = save_state(
        build_model(args, seed=3).state_dict(), args, tokenizer, root / "base", stage="test",
        parent=None,
    )  # fmt: skip
    rows = [json.loads(line) for line in paths["dpo_train"].read_text().splitlines()][:32]
    prompts = _write_rows(
        root / "prompts.jsonl", [{"prompt": r["prompt"], "answer": r["chosen"]} for r in rows]
    )
    reward = root / "rewards.py"
    reward.write_text(REWARD_CODE)
    return base, prompts, reward


@pytest.fixture(scope="module")
def grpo_world(tmp_path_factory):
    return _grpo_world(tmp_path_factory.mktemp("grpo"))


@pytest.fixture(scope="module")
def grpo_qwen3_world(tmp_path_factory):
    """The same with a tied Qwen3 (q/k head norms, head_dim 24 != dim / heads)."""
    return _grpo_world(tmp_path_factory.mktemp("grpo-qwen3"), family="qwen3")


@pytest.fixture(scope="module")
def grpo_wide_world(tmp_path_factory):
    """The same, wide enough (dim 256) that each NF4 base splits into 2 FSDP shards of whole
    scale groups (QLoRA over two processes)."""
    return _grpo_world(tmp_path_factory.mktemp("grpo-wide"), dim=256, ffn_dim=512)


def grpo_args(run_dir: Path, world, *extra: str) -> list[str]:
    base, prompts, reward = world
    return [
        f"run_dir={run_dir}",
        f"model.source={base}",
        f"data.path={prompts}",
        "data.max_seq_len=40",
        "train.steps=20",
        "train.micro_batch_size=16",
        "train.deterministic=true",
        "optim.lr=3e-2",
        "scheduler.warmup_steps=1",
        "metrics.log_every=1",
        "metrics.tensorboard=false",
        "checkpoint.every=0",
        "grpo.prompts_per_step=4",
        "grpo.num_generations=8",
        "grpo.max_new_tokens=12",
        f'grpo.rewards=[{{kind = "python", function = "{reward}:letter_e"}}]',
        *extra,
    ]


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_reward_rises_on_a_learnable_reward_through_the_cli(tmp_path, grpo_world, capsys):
    from tests.train_utils import run_inprocess

    _, prompts, _ = grpo_world
    heldout = ["grpo.eval_every=10", f"data.heldout={prompts}"]  # (the same prompts, greedy)
    assert run_inprocess("grpo", grpo_args(tmp_path / "run", grpo_world, *heldout)) == 0
    assert "step 20: loss" in (err := capsys.readouterr().err) and ", reward 0." in err
    records = _records(tmp_path / "run")
    assert sorted(records) == list(range(1, 21))
    rewards = [records[s]["reward"] for s in range(1, 21)]
    start, end = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert end > start + 0.2, rewards
    first = records[1]
    assert math.isclose(first["reward_letter_e"], first["reward"])  # one reward, weight 1
    assert first["logprob_gap"] < 1e-4  # the engine and the trainer score alike (CPU fp32)
    assert first["prompt_tokens_shared"] > 0  # a group prefills its prompt once
    for key in (
        "clip_fraction", "entropy", "completion_len", "groups_dropped", "rollout_tokens_per_s",
        "weight_sync_s", "rollout_s", "scoring_s", "logprob_s", "update_s",
    ):  # fmt: skip
        assert math.isfinite(first[key]), key
    evaluated = [step for step, record in records.items() if "val_reward" in record]
    assert evaluated == [10, 20]
    assert records[20]["val_reward"] >= records[10]["val_reward"] > 0.5  # greedy: sharper
    assert records[20]["val_reward_letter_e"] == records[20]["val_reward"]
    lineage = json.loads((tmp_path / "run" / "artifact" / "lmforge.json").read_text())
    assert lineage["stage"] == "grpo" and lineage["parent"]["source"] == str(grpo_world[0])


@pytest.mark.parametrize(
    "extra, reference",
    [
        (["lora.enabled=true", "lora.rank=4", "grpo.beta=0.1"], "adapters_disabled"),
        (
            ["lora.enabled=true", "lora.rank=4", "lora.quantize_base=nf4", "grpo.beta=0.1"],
            "adapters_disabled",
        ),
        (["grpo.beta=0.1", "grpo.mu=2", "grpo.loss_aggregation=sequence"], "frozen_copy"),
        (  # bf16 bases beside fp32 embeddings: the engine samples under the trainer's autocast
            ["lora.enabled=true", "lora.rank=4", "grpo.beta=0.1", "train.mixed_precision=bf16"],
            "adapters_disabled",
        ),
    ],
    ids=["lora-kl", "qlora-kl", "full-kl-mu2-sequence", "bf16-lora-kl"],
)
def test_kl_to_the_reference_grows_from_zero(tmp_path, grpo_world, extra, reference):
    from lmforge.train.grpo import reference_kind
    from tests.train_utils import run_inprocess

    args = grpo_args(tmp_path / "run", grpo_world, "train.steps=4", *extra)
    assert reference_kind(load_config(GRPOJob, None, args)) == reference
    assert run_inprocess("grpo", args) == 0
    records = _records(tmp_path / "run")
    assert records[1]["kl"] < 1e-9  # the policy starts as its reference
    assert records[4]["kl"] > records[1]["kl"]
    # the engine samples from the weights as trained (bf16: both sides round their own way)
    assert records[4]["logprob_gap"] < (0.05 if "bf16" in str(extra) else 1e-4)
    if "grpo.mu=2" in extra:  # the second step on a rollout batch moved away from its sampler
        assert records[1]["clip_fraction"] == records[3]["clip_fraction"] == 0
        assert records[2]["clip_fraction"] > 0 and records[4]["clip_fraction"] > 0
    if "lora.enabled=true" in extra:
        assert (tmp_path / "run" / "artifact" / "adapter" / "adapter_config.json").is_file()


def test_kill_and_resume_matches_uninterrupted(tmp_path, grpo_world):
    """SIGKILL mid-run, resumed from its last checkpoint: every later step logs the same loss
    and reward (sampling seeded by rollout index; with mu = 2 a checkpoint falls between the
    two steps of a rollout batch, whose sequences the checkpoint keeps)."""
    import os
    import subprocess
    import sys

    from tests.train_utils import kill_all, run_inprocess, wait_for_step

    extra = ["train.steps=10", "checkpoint.every=3", "grpo.mu=2"]
    assert run_inprocess("grpo", grpo_args(tmp_path / "reference", grpo_world, *extra)) == 0
    reference = _records(tmp_path / "reference")
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge", "grpo", *grpo_args(run_dir, grpo_world, *extra)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1", "GRPO_TEST_REWARD_SLEEP": "0.01"},
    )
    wait_for_step(run_dir, 4, proc)
    kill_all(proc)
    (run_dir / "metrics.jsonl").unlink()
    assert run_inprocess("grpo", grpo_args(run_dir, grpo_world, *extra)) == 0
    resumed = _records(run_dir)
    assert min(resumed) in (4, 7) and max(resumed) == 10
    for step, record in resumed.items():
        for key in ("loss", "reward", "grad_norm"):
            assert record[key] == reference[step][key], (step, key)


def test_user_mistakes_exit_2_with_one_line(tmp_path, grpo_world, capsys):
    from tests.train_utils import run_inprocess

    bad_rows = _write_rows(tmp_path / "bad.jsonl", [{"prompt": "Where?"}, {"question": "x"}])
    code = run_inprocess("grpo", grpo_args(tmp_path / "a", grpo_world, f"data.path={bad_rows}"))
    assert code == 2 and "bad.jsonl:2" in capsys.readouterr().err
    missing = f'grpo.rewards=[{{kind = "python", function = "{tmp_path}/none.py:f"}}]'
    assert run_inprocess("grpo", grpo_args(tmp_path / "b", grpo_world, missing)) == 2
    assert f"{tmp_path}/none.py is not a file" in capsys.readouterr().err
    raising = tmp_path / "raising.py"
    raising.write_text("def bad(completion, sample):\n    raise KeyError('score')\n")
    bad = f'grpo.rewards=[{{kind = "python", function = "{raising}:bad"}}]'
    assert run_inprocess("grpo", grpo_args(tmp_path / "d", grpo_world, bad)) == 2
    err = capsys.readouterr().err
    assert f"reward '{raising}:bad' failed on sample {grpo_world[1]}:" in err and "KeyError" in err
    no_reward = grpo_args(tmp_path / "c", grpo_world, "grpo.rewards=[]")
    assert run_inprocess("grpo", no_reward) == 2
    assert "grpo.rewards is empty" in capsys.readouterr().err


def test_config_show_lists_the_grpo_keys(capsys):
    from tests.train_utils import run_inprocess

    assert run_inprocess("config", ["show", "grpo"]) == 0
    shown = capsys.readouterr().out
    for key in ("num_generations", "clip_high", "scale_rewards", "loss_aggregation", "mu", "beta"):
        assert f"{key} =" in shown, key
    assert "prompt_field" in shown and "global_batch_size = 64" in shown


def test_pipeline_stage_runs_grpo_from_an_artifact(tmp_path, grpo_world):
    """kind = "grpo" resolves to `lmforge grpo --config stage.toml`, a validated GRPOJob, runs
    through the local launcher and writes an artifact whose lineage names its input."""
    from lmforge.launch.local import LocalLauncher
    from lmforge.pipeline import load_pipeline, run_pipeline

    base, prompts, reward = grpo_world
    file = tmp_path / "p.toml"
    file.write_text(
        f'[pipeline]\nname = "p"\nreport = false\n[model]\nsource = "{base}"\n'
        '[stages.rl]\nkind = "grpo"\n'
        f'data.path = ["{prompts}"]\ndata.max_seq_len = 40\n'
        "train.steps = 2\ntrain.micro_batch_size = 8\nmetrics.tensorboard = false\n"
        "grpo.prompts_per_step = 2\ngrpo.num_generations = 4\ngrpo.max_new_tokens = 8\n"
        f'grpo.rewards = [{{kind = "python", function = "{reward}:letter_e"}}]\n'
    )
    pipeline = load_pipeline(file, workdir=tmp_path)
    (stage,) = pipeline.stages
    assert stage.argv == ["grpo", "--config", "runs/p/rl/stage.toml"]
    assert stage.config.grpo.rewards[0].function == f"{reward}:letter_e"
    assert stage.config.train.global_batch_size == 8
    lines: list[str] = []
    result = run_pipeline(pipeline, launcher=LocalLauncher(stream=None), echo=lines.append)
    assert result.ok, "\n".join(lines)
    lineage = json.loads((tmp_path / "runs/p/rl/artifact/lmforge.json").read_text())
    assert lineage["stage"] == "grpo" and lineage["parent"]["source"] == str(base)
    file.write_text(file.read_text().replace("grpo.rewards = [", "grpo.rewardz = ["))
    with pytest.raises(ConfigError, match=r"grpo\.rewardz"):
        load_pipeline(file, workdir=tmp_path)


# ---- the planner ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_plan_counts_the_rollout_replica_as_it_is_built(method):
    """Under FSDP the engine samples from an unsharded replica: the planner's bytes for it equal
    the parameters of the replica the stage builds (fp32 trained weights, bf16 frozen
    linears, QLoRA's bases in NF4)."""
    from lmforge.modules.lora import LoRASection
    from lmforge.plan.memory import Setup, plan_memory
    from lmforge.sizes import tensor_bytes
    from lmforge.train.replica import unsharded_model
    from tests.train_utils import small_args

    args = small_args(400, dim=256, ffn_dim=512, tie_embeddings=False)
    lora = None
    if method != "full":
        lora = LoRASection(
            enabled=True, rank=4, quantize_base="nf4" if method == "qlora" else "none"
        )
    replica = unsharded_model(args, lora, torch.device("cpu"), bf16=True)
    built = sum(tensor_bytes(p) for p in replica.parameters())
    setup = Setup(args=args, method=method, lora_rank=4, gpus=2, grpo_generations=8)
    planned = plan_memory(setup, "h200").phases["rollout (engine)"]["rollout replica"]
    assert planned == built


def test_plan_counts_the_engine_cache_and_the_reference(capsys):
    from lmforge.models import get_preset
    from lmforge.plan.memory import GiB, Setup, kv_cache_bytes, plan_memory, setup_from_job
    from tests.train_utils import run_inprocess

    args = get_preset("llama3.2-1b")
    setup = Setup(args=args, grpo_generations=8, grpo_prompts=64, seq_len=1024)
    # K and V, 16 layers, 512 rows × 1024 slots, 8 kv heads × 64, bf16 weights (one GPU)
    assert kv_cache_bytes(setup) == 2 * 16 * 512 * 1024 * 512 * 2 == 16 * GiB
    plan = plan_memory(setup, "h200")
    assert plan.phases["rollout (engine)"]["KV cache"] == 16 * GiB
    assert setup.reference is None and plan.largest("reference model") == 0  # beta = 0
    with_kl = plan_memory(setup.replace(grpo_reference="auto"), "h200")
    assert with_kl.largest("reference model") > 2 * GiB  # a frozen bf16 copy of 1.24B
    # FSDP over 4 GPUs: each rank samples 16 prompts × 8 on an unsharded replica, keys,
    # values and weights in bf16 (FSDP's mixed precision computes in it)
    fsdp = setup.replace(gpus=4)
    assert kv_cache_bytes(fsdp) == 2 * 16 * 128 * 1024 * 512 * 2 == 4 * GiB
    rollout = plan_memory(fsdp, "h200").phases["rollout (engine)"]
    assert rollout["rollout replica"] == args.num_params() * 2
    # TP 2 alone: each rank samples all 512 rows with half of the KV heads; its fp32 shards
    # are copied into bf16 before each rollout (else every decode step would cast them)
    tp = setup.replace(gpus=2, tp=2)
    assert kv_cache_bytes(tp) == 2 * 16 * 512 * 1024 * 256 * 2
    shard = plan_memory(tp, "h200").phases["rollout (engine)"]["rollout replica"]
    assert args.num_params() * 2 / 2 < shard < args.num_params() * 2 / 2 * 1.1  # norms whole
    fp32 = tp.replace(compute_dtype="fp32")  # the policy's own shards: no copy
    # one GPU, grpo.fuse_rollouts: q/k/v and gate/up once more, bf16 (with fp32 masters)
    fused = plan_memory(setup.replace(grpo_fuse_rollouts=True), "h200").phases["rollout (engine)"]
    assert fused["rollout replica"] == 16 * (2048 * 2048 + 2 * 512 * 2048 + 2 * 8192 * 2048) * 2
    assert plan_memory(fp32, "h200").phases["rollout (engine)"].get("rollout replica", 0) == 0
    lora = setup.replace(method="lora", grpo_reference="auto")
    assert lora.reference == "adapters_disabled"
    assert plan_memory(lora, "h200").largest("reference model") == 0
    # the logits cover the completion tokens alone (`logits_at`): 256 of a 1024-position row
    assert setup.logit_tokens == setup.micro_batch_size * 256 == setup.tokens // 4
    assert setup.replace(grpo_new_tokens=4096).logit_tokens == setup.micro_batch_size * 1023
    # bf16 logits kept, then their gradient beside them, and a chunk's fp32 temporaries: at most
    # 2^26 values (512 rows of 128,256), four in the forward, three in the backward
    from lmforge.plan.memory import GRPO_LOSS_CHUNK
    from lmforge.train.grpo_loss import CHUNK_VALUES

    assert GRPO_LOSS_CHUNK == CHUNK_VALUES
    for tokens, micro_batch in ((256, 1), (64, 1), (256, 16)):
        values = micro_batch * tokens * 128256
        chunk = min(values, 2**26)
        shape = setup.replace(grpo_new_tokens=tokens, micro_batch_size=micro_batch)
        phases = plan_memory(shape, "h200").phases
        assert phases["forward end (loss)"]["logits and loss"] == 2 * values + 16 * chunk
        assert phases["loss backward"]["logits and loss"] == 4 * values + 12 * chunk
        assert phases["rollout scoring"]["logits and loss"] == 2 * values + 16 * chunk
    # grpo.share_prompts: a row per prompt, P + G·C wide under a dense bool mask: at 8 × 4096
    # new tokens 2 rows of 128 + 8 × 4096 a micro-batch of 16 or 12 (8 + 4 or 4 + 8 sequences
    # of a prompt), 3 of 17 (a micro-batch starting anywhere in a group)
    long = setup.replace(seq_len=4224, grpo_new_tokens=4096, micro_batch_size=16)
    assert long.mask_bytes == 0 and long.replace(document_masking=True).mask_bytes == 16 * 4224**2
    shared = long.replace(grpo_share_prompts=True)
    assert shared.mask_bytes == 2 * (128 + 8 * 4096) ** 2
    assert shared.replace(micro_batch_size=12).mask_bytes == shared.mask_bytes
    assert shared.replace(micro_batch_size=17).mask_bytes == 3 * (128 + 8 * 4096) ** 2
    extra = plan_memory(shared, "h200").largest("activations")
    assert extra - plan_memory(long, "h200").largest("activations") == shared.mask_bytes

    job = load_config(
        GRPOJob,
        None,
        ["model.source=llama3.2-1b", "grpo.beta=0.04", "grpo.num_generations=4",
         "grpo.max_new_tokens=100"],
    )  # fmt: skip
    from_job = setup_from_job(job, gpus=1)
    assert (from_job.grpo_generations, from_job.grpo_prompts) == (4, 8)
    assert from_job.grpo_new_tokens == 100 and from_job.document_masking  # packed rows
    assert from_job.reference == "frozen_copy" and from_job.grad_accumulation == 4
    from lmforge.plan.search import plan_job  # what `lmforge run` plans a grpo stage with

    staged = plan_job(job, gpus=1, gpu_memory="h100")
    assert staged.largest("KV cache") == kv_cache_bytes(from_job) > 0

    command = ["--model", "llama3.2-1b", "--method", "grpo", "--prompts", "64", "--seq-len", "1024"]
    assert run_inprocess("plan", [*command, "--gpu-memory", "h200"]) == 0
    out = capsys.readouterr().out
    assert "GRPO, full finetuning: 64 prompts × 8 completions (KL reference: none)" in out
    assert "GRPO engine KV cache (512 rows × 1024 slots)" in out and "512 accumulation steps" in out
    assert "logits and loss (bf16 [256, 128256], fp32 chunks of rows)" in out
    assert run_inprocess("plan", [*command, "--max-new-tokens", "64"]) == 0
    # a KV cache that does not fit: fewer rows at once is the cheapest way out
    big = ["--model", "llama3.2-1b", "--method", "grpo", "--prompts", "512", "--seq-len", "4096"]
    assert run_inprocess("plan", [*big, "--gpu-memory", "h100"]) == 1  # does not fit
    assert "1. --rollout-batch 256 " in capsys.readouterr().out
    assert run_inprocess("plan", ["--model", "llama3.2-1b", "--prompts", "8"]) == 2
    assert "--prompts: only with --method grpo" in capsys.readouterr().err


# ---- the engine: one prefill for a group's prompt --------------------------------------------


def test_a_groups_sequences_copy_the_prompt_prefilled_once():
    """G completions of one prompt: the first prefills it, the others copy its cached slots
    and run only its last token; they sample exactly what G separate prefills sample."""
    from lmforge.api import build_model
    from lmforge.generate import Engine, SamplingParams
    from tests.train_utils import small_args

    model = build_model(small_args(vocab_size=64), seed=0)
    prompts = [[1, 5, 9, 13, 17, 21, 3], [2, 4, 6, 8]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=())

    def run(share: bool):
        engine = Engine(model, max_batch=8, max_seq_len=32, compile=False)
        sequences = []
        for i, prompt in enumerate(prompts):
            first = None
            for j in range(4):
                sequence = engine.sequence(
                    prompt, params, index=4 * i + j, seed=4 * i + j, num_logprobs=0,
                    shares_prompt_with=first if share else None,
                )  # fmt: skip
                first = first or sequence
                sequences.append(sequence)
        engine.add(sequences)
        logprobs = {s.index: [] for s in sequences}
        while engine.has_work:
            for sequence, event in engine.step():
                logprobs[sequence.index].append(event.logprob)
        return [s.token_ids for s in sequences], logprobs, engine.num_shared_prompt_tokens

    tokens, logprobs, shared = run(share=True)
    alone_tokens, alone_logprobs, none_shared = run(share=False)
    assert shared == 3 * 6 + 3 * 3 and none_shared == 0
    assert tokens == alone_tokens
    for index, values in logprobs.items():
        assert np.allclose(values, alone_logprobs[index], atol=1e-5)
    with pytest.raises(ConfigError, match="their tokens differ"):
        engine = Engine(model, max_batch=2, max_seq_len=32, compile=False)
        first = engine.sequence([1, 2, 3], params)
        engine.sequence([1, 2, 4], params, index=1, shares_prompt_with=first)


def test_demo_questions_ask_about_training_people_only(world):
    """The demo's grpo_train.jsonl: chat questions with their short answers, about the DPO
    people (never a held-out one), readable by the prompt loader."""
    from lmforge.data.demo import make_facts, split_people

    paths, tokenizer, _ = world
    rows = [json.loads(line) for line in paths["grpo_train"].read_text().splitlines()]
    facts = {(f.question, f.answer): f.name for f in make_facts()}
    _, heldout = split_people(make_facts())
    sft_rows = [
        json.loads(line)["messages"] for line in paths["sft_train"].read_text().split("\n")[:-1]
    ]
    sft_names = {facts[(question["content"], answer["content"])] for question, answer in sft_rows}
    names = {facts[(row["messages"][0]["content"], row["answer"])] for row in rows}
    assert names and not names & heldout and not names & sft_names
    data = load_prompt_data(
        PromptDataSection(path=[str(paths["grpo_train"])]), tokenizer, max_prompt_len=64
    )
    assert len(data.samples) == len(rows) == 3 * len(names)


LORA = ["lora.enabled=true", "lora.rank=4"]
FSDP_2 = (2, ["train.micro_batch_size=8"])


@pytest.mark.parametrize(
    "world_name, extra, layout",
    [
        ("grpo_world", [], FSDP_2),
        ("grpo_world", LORA, FSDP_2),
        ("grpo_wide_world", [*LORA, "lora.quantize_base=nf4"], FSDP_2),
        ("grpo_world", [], (2, ["parallel.tp=2"])),
        ("grpo_world", [], (4, ["parallel.tp=2", "train.micro_batch_size=8"])),
        ("grpo_qwen3_world", [], (2, ["parallel.tp=2"])),
        ("grpo_qwen3_world", LORA, FSDP_2),
    ],
    ids=["full", "lora", "qlora", "tp", "tp-fsdp", "qwen3-tied-tp", "qwen3-tied-lora"],
)
def test_several_processes_match_one(tmp_path, request, world_name, extra, layout):
    """Over gloo processes the same losses and rewards as one process (every sequence draws
    from a seed of its own). FSDP: each rank samples for half of the prompts on a replica of
    the gathered weights (QLoRA: its NF4 bases gathered packed); TP: both ranks sample the same
    prompts on their shards of the policy's own tensors (TP x FSDP: gathered over FSDP)."""
    from tests.train_utils import run_inprocess, run_torchrun

    grpo_world = request.getfixturevalue(world_name)
    nproc, parallel = layout
    args = ["train.steps=4", "grpo.mu=2", *extra]
    assert run_inprocess("grpo", grpo_args(tmp_path / "one", grpo_world, *args)) == 0
    one = _records(tmp_path / "one")
    run_torchrun(nproc, "grpo", grpo_args(tmp_path / "many", grpo_world, *args, *parallel))
    many = _records(tmp_path / "many")
    assert sorted(many) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        keys = ("reward", "completion_len", "groups_dropped", "prompt_tokens_shared")
        for key in keys:  # the same samples (prompt_tokens_shared: summed over the dp ranks)
            assert many[step][key] == pytest.approx(one[step][key], rel=1e-9), key
        # the same updates, to the sums' order (at lr 3e-2 the fourth step's loss moves 2e-4)
        for key in ("loss", "grad_norm"):
            assert many[step][key] == pytest.approx(one[step][key], rel=1e-3, abs=1e-5), key
        assert many[step]["logprob_gap"] < 1e-4  # the replica samples what the shards train


@pytest.mark.parametrize("parallel", [FSDP_2[1], ["parallel.tp=2"]], ids=["fsdp", "tp"])
def test_bf16_replicas_sample_what_the_trainer_scores(tmp_path, grpo_world, parallel):
    """Computing in bf16 (train.mixed_precision), the replicas hold bf16 copies (FSDP: of the
    gathered weights; TP: of the fp32 shards) and a bf16 KV cache: the engine's log-probabilities
    stay within bf16's rounding of the trainer's."""
    from tests.train_utils import run_torchrun

    args = ["train.steps=4", "grpo.mu=2", "train.mixed_precision=bf16", *parallel]
    run_torchrun(2, "grpo", grpo_args(tmp_path, grpo_world, *args))
    records = _records(tmp_path)
    assert sorted(records) == [1, 2, 3, 4]  # two rollouts: the second after two updates
    assert all(0 < r["logprob_gap"] < 0.02 for r in records.values())  # fp32: < 1e-4


def test_replicas_fuse_the_projections_and_compute_the_policys_logits():
    """The gathered replica (FSDP's; here over a plain module) and the one-process fused one
    run one q/k/v and one gate/up matmul a block, with the policy's logits; the fused one
    shares every other tensor with the policy, and takes its q/k/v again at the next call."""
    from lmforge.api import build_model
    from lmforge.train.replica import FusedReplica, GatheredReplica, unsharded_model
    from tests.train_utils import small_args

    args = small_args(64)
    policy = build_model(args, seed=0).eval()
    tokens = torch.arange(1, 9)[None]
    gathered = GatheredReplica(policy, lambda: unsharded_model(args, None, "cpu", False))
    fused = FusedReplica(policy, args, torch.device("cpu"))
    for replica in (gathered, fused):
        model = replica.model()
        assert (
            model.layers["0"].attention.wqkv is not None
            and model.layers["0"].feed_forward.w13 is not None
        )
        torch.testing.assert_close(model(tokens), policy(tokens), rtol=0, atol=1e-5)
    block = fused.model().layers["0"]
    assert block.attention.wo.weight.data_ptr() == policy.layers["0"].attention.wo.weight.data_ptr()
    with torch.no_grad():
        policy.layers["0"].attention.wk.weight.mul_(2.0)  # an update, in place
    torch.testing.assert_close(fused.model()(tokens), policy(tokens), rtol=0, atol=1e-5)


def test_tensor_parallel_rollouts_need_a_vocabulary_that_splits():
    """The TP replica gathers the logits over the vocabulary: one that does not split over the
    tensor-parallel ranks is a ConfigError naming both numbers."""
    from types import SimpleNamespace

    from lmforge.errors import ConfigError
    from lmforge.train.replica import TensorParallelReplica
    from tests.train_utils import small_args

    layout = SimpleNamespace(tp_size=2, dp_size=1)
    with pytest.raises(ConfigError, match=r"parallel.tp = 2 .* \(vocab_size 401\)"):
        TensorParallelReplica(torch.nn.Linear(2, 2), small_args(401), layout, bf16=False)


@pytest.mark.parametrize("option", ["grpo.fuse_rollouts=true", "grpo.share_prompts=true"])
def test_speed_options_train_as_the_plain_run(tmp_path, grpo_world, option):
    """grpo.fuse_rollouts (the engine runs one q/k/v and one gate/up matmul a block over copies
    refreshed before each rollout, the second after two updates too) and grpo.share_prompts (a
    group's prompt once a row in the update's forwards): the same samples, losses and
    engine-trainer gap as the plain run."""
    from tests.train_utils import run_inprocess

    args = ["train.steps=4", "grpo.mu=2"]
    for name, extra in (("plain", []), ("option", [option])):
        assert run_inprocess("grpo", grpo_args(tmp_path / name, grpo_world, *args, *extra)) == 0
    plain, other = _records(tmp_path / "plain"), _records(tmp_path / "option")
    for step in (1, 2, 3, 4):
        assert other[step]["reward"] == pytest.approx(plain[step]["reward"], abs=1e-9)
        assert other[step]["loss"] == pytest.approx(plain[step]["loss"], rel=1e-4, abs=1e-6)
        assert other[step]["logprob_gap"] < 1e-4


def test_sequence_ratios_train_through_the_cli(tmp_path, grpo_world):
    """grpo.importance_sampling = "sequence" (GSPO) through `lmforge grpo` with μ = 2: the first
    update of a rollout batch is GRPO's (every ratio 1), the second clips whole completions at
    the paper's clips."""
    from tests.train_utils import run_inprocess

    args = ["train.steps=2", "grpo.mu=2", "grpo.clip_low=3e-4", "grpo.clip_high=4e-4"]
    for name, extra in (("token", []), ("sequence", ["grpo.importance_sampling=sequence"])):
        assert run_inprocess("grpo", grpo_args(tmp_path / name, grpo_world, *args, *extra)) == 0
    token, sequence = _records(tmp_path / "token"), _records(tmp_path / "sequence")
    assert sequence[1]["loss"] == pytest.approx(token[1]["loss"], rel=1e-5, abs=1e-7)
    assert sequence[1]["clip_fraction"] == token[1]["clip_fraction"] == 0
    assert sequence[2]["loss"] != pytest.approx(token[2]["loss"], rel=1e-5, abs=1e-7)
    assert 0 < sequence[2]["clip_fraction"] < 1


def test_samples_do_not_depend_on_the_engine_batch(tmp_path, grpo_world):
    """Each sequence draws from a seed of its own: a cache of 5 rows (continuous batching over
    the 32 sequences) samples what a cache of all 32 does."""
    from tests.train_utils import run_inprocess

    for name, extra in (("all", []), ("five", ["grpo.rollout_batch=5"])):
        args = grpo_args(tmp_path / name, grpo_world, "train.steps=2", *extra)
        assert run_inprocess("grpo", args) == 0
    every, five = _records(tmp_path / "all"), _records(tmp_path / "five")
    for step in (1, 2):
        assert five[step]["reward"] == every[step]["reward"]
        assert five[step]["completion_len"] == every[step]["completion_len"]
        assert abs(five[step]["loss"] - every[step]["loss"]) < 1e-6


def test_a_resume_on_other_ranks_samples_a_new_rollout_batch():
    """A checkpoint of 2 ranks resumed on 1: the prompt order and rollout count carry over;
    the unfinished rollout batch (rank 0's share only) is dropped, not trained on by all."""
    from lmforge.data.prompts import PromptLoader, PromptSample
    from lmforge.train.config import GRPOSection
    from lmforge.train.rollout import Rollouts

    samples = [PromptSample(np.array([1, 2, i]), where=f"p:{i}") for i in range(8)]

    def rollouts(dp_rank: int, dp_size: int) -> Rollouts:
        loader = PromptLoader(
            samples, micro_batch_size=4 // dp_size, dp_rank=dp_rank, dp_size=dp_size, max_seq_len=8
        )
        return Rollouts(
            prompts=loader, tokenizer=None, rewards=[], grpo=GRPOSection(mu=2),
            micro_batch_size=4, num_micro_batches=1, max_seq_len=16, pad_id=0,
            device=torch.device("cpu"), bf16=False, seed=0, dp_rank=dp_rank, dp_size=dp_size,
        )  # fmt: skip

    saved = rollouts(0, 2)
    next(saved.prompts)  # the prompts of the rollout batch being trained on
    saved.num_rollouts, saved.handed_out = 3, 1
    saved.batches = [{"inputs": torch.zeros(1, 1, dtype=torch.long)}]
    state = saved.state_dict()
    resumed = rollouts(0, 1)
    resumed.load_resharded_state_dict(state, saved_world_size=2)
    assert (resumed.num_rollouts, resumed.handed_out, resumed.batches) == (3, 0, [])
    assert resumed.prompts.items_consumed == 4  # the next batch: prompts 4.. of the order
    same = rollouts(0, 2)
    same.load_state_dict(state)  # the same ranks: the unfinished batch goes on
    assert (same.handed_out, len(same.batches)) == (1, 1)


def _small_rollouts(grpo, *, device="cpu", bf16=False):
    """Rollouts of 4 three-token prompts (ids 1, 2, 3 + i) with the even-ids reward, one
    micro-batch of 8 sequences, over 16 positions; `bind` them to a model."""
    from lmforge.data.prompts import PromptLoader, PromptSample
    from lmforge.train import rollout as rollout_module
    from lmforge.train.rewards import Reward

    samples = [PromptSample(np.array([1, 2, 3 + i]), where=f"p:{i}") for i in range(4)]
    reward = Reward(
        name="even", weight=1.0, checks_correctness=False, description="even",
        score_fn=lambda c: sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1),
    )  # fmt: skip
    return rollout_module.Rollouts(
        prompts=PromptLoader(samples, micro_batch_size=4, max_seq_len=16),
        tokenizer=None, rewards=[reward], grpo=grpo, micro_batch_size=8,
        num_micro_batches=1, max_seq_len=16, pad_id=0, device=torch.device(device),
        bf16=bf16, seed=0,
    )  # fmt: skip


def test_shared_prompts_give_the_same_log_probabilities_and_gradients():
    """grpo.share_prompts: a group's prompt once a row, its completions after it: the same
    log-probability at every completion token and the same gradients as whole sequences
    packed apart, on fewer positions."""
    from lmforge.api import build_model
    from lmforge.train.config import GRPOSection
    from lmforge.train.grpo_loss import GRPOLossStep, completion_logps
    from lmforge.train.rollout import Rollout
    from tests.train_utils import small_args

    model = build_model(small_args(vocab_size=64), seed=0)
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(1, 64, (n,), generator=g).tolist()

    prompts = [ids(5), ids(3), ids(1)]  # (a one-token prompt: nothing before its last token)
    chunk = [
        Rollout(prompts[i // 3], ids(2 + i % 4), advantage=i - 3.5, engine_logps=None)
        for i in range(8)
    ]
    seen = {}
    for share in (False, True):
        grpo = GRPOSection(share_prompts=share, loss_aggregation="sequence")
        batch, _ = _small_rollouts(grpo)._pack(chunk)
        model.zero_grad()
        step = GRPOLossStep(clip_low=0.2, clip_high=0.28, beta=0.0, temperature=1.0)
        step(model, batch).loss_sum.backward()
        logps = completion_logps(model, batch)[batch["labels"] != -100]
        real = (batch["document_ids"] < len(chunk) + 1).sum() if "document_ids" in batch else None
        seen[share] = logps.detach(), [p.grad.clone() for p in model.parameters()], real
    torch.testing.assert_close(seen[True][0], seen[False][0], rtol=0, atol=1e-5)
    for shared, plain in zip(seen[True][1], seen[False][1]):
        torch.testing.assert_close(shared, plain, rtol=1e-4, atol=1e-6)
    # positions: whole sequences 3·5 + 3·3 + 2·1 - 8 + Σ completions; shared, 4 + 2 fewer
    assert seen[False][2] - seen[True][2] == 2 * 4 + 2 * 2


def test_truncated_completions_leave_the_update_but_count_in_their_group():
    """grpo.mask_truncated (DAPO's overlong filtering): completions cut before a stop are not
    trained on, but their rewards still shape their group's advantages; they are counted."""
    from types import SimpleNamespace

    from lmforge.train.config import GRPOSection
    from lmforge.train.grpo_loss import group_advantages

    def result(ids, reason):
        return SimpleNamespace(token_ids=ids, text="", finish_reason=reason)

    # the even-ids reward: 1, 0 | 1, 0.5 (the last one cut at max_new_tokens)
    results = [
        result([2], "stop"),
        result([3], "stop"),
        result([4], "stop"),
        result([6, 7], "length"),
    ]
    for mask in (False, True):
        grpo = GRPOSection(num_generations=2, drop_equal_groups=False, mask_truncated=mask)
        rollouts = _small_rollouts(grpo)
        prompts = [next(iter(rollouts.prompts))[i] for i in range(2)]
        kept, metrics = rollouts._score(prompts, results, None)
        rewards = torch.tensor([[1.0, 0.0], [1.0, 0.5]], dtype=torch.float64)
        expected, _ = group_advantages(rewards, scale=True)
        assert [r.advantage for r in kept] == expected.flatten().tolist()[: len(kept)]
        assert [r.completion_ids for r in kept] == (
            [[2], [3], [4]] if mask else [[2], [3], [4], [6, 7]]
        )
        assert metrics.get("truncated_masked") == (1.0 if mask else None)


def test_a_decode_step_that_does_not_compile_leaves_the_rollouts_eager(monkeypatch, caplog):
    """Where the rollout engine's compiled decode step fails to compile (a torch.compile
    error), the rollout warns and runs again on an eager engine, which samples what an engine
    made eager from the start samples (the same seeds), and the run stays eager."""
    from lmforge.api import build_model
    from lmforge.generate import Engine
    from lmforge.train import rollout as rollout_module
    from lmforge.train.config import GRPOSection
    from tests.train_utils import small_args

    class FailsToCompile(Engine):
        """An engine whose compile attempt (compile=None) fails at its first decode step."""

        def __init__(self, *args, compile=None, **kwargs):
            super().__init__(*args, compile=False, **kwargs)
            self.compiled = compile is None

        def decode_rows(self, *args, **kwargs):
            if self.compiled:
                raise torch._dynamo.exc.TorchDynamoException("inductor: boom")
            return super().decode_rows(*args, **kwargs)

    monkeypatch.setattr(rollout_module, "Engine", FailsToCompile)

    def first_rollout(compile_rollouts: bool) -> list:
        grpo = GRPOSection(num_generations=2, max_new_tokens=5, compile_rollouts=compile_rollouts)
        rollouts = _small_rollouts(grpo)
        rollouts.bind(build_model(small_args(vocab_size=64), seed=0), reference=None, base=False)
        batch = next(rollouts)
        assert not rollouts.engine.compiled
        return batch["inputs"].tolist(), rollouts

    with caplog.at_level("WARNING"):
        tried, rollouts = first_rollout(compile_rollouts=True)
    assert "did not compile (TorchDynamoException: inductor: boom)" in caplog.text
    assert rollouts.eager and tried == first_rollout(compile_rollouts=False)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_compiled_rollout_engine_compiles_once_and_holds_no_cache_between_rollouts():
    """On a GPU (fp32 weights under bf16 autocast, as `lmforge grpo` trains with LoRA or
    without bf16 weights) the rollout engine compiles its decode step at the first rollout
    only, gives its KV cache back after each, records its graphs again at the next (without
    warm-up runs), and samples what the trainer scores (the engine-trainer gap of bf16
    rounding)."""
    from lmforge.api import build_model
    from lmforge.train.config import GRPOSection
    from tests.train_utils import small_args

    rollouts = _small_rollouts(
        GRPOSection(num_generations=2, max_new_tokens=5, mu=2), device="cuda", bf16=True
    )
    rollouts.bind(build_model(small_args(vocab_size=64), seed=0).cuda(), reference=None, base=False)
    next(rollouts)  # the first rollout: compiles, records its graphs
    assert rollouts.engine.compiled and rollouts.engine.graphs is not None
    caches = rollouts.engine.caches.tensors()
    assert all(t.untyped_storage().nbytes() == 0 for t in caches)  # given back
    warmed = set(rollouts.engine.graphs.warmed)
    torch._dynamo.utils.counters.clear()
    for _ in range(3):  # the first rollout's second micro-batch pass, then the next rollout
        next(rollouts)
    assert rollouts.num_rollouts == 2
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]  # not compiled again
    assert all(t.untyped_storage().nbytes() == 0 for t in caches)
    assert warmed and warmed <= set(rollouts.engine.graphs.warmed)
    assert rollouts.metrics["logprob_gap"] < 0.05
