"""Preference data: row layouts (text, chat prompts, HH / UltraFeedback shared-prefix
conversations), response-only labels, the truncation policy, errors and the DPO batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.demo import write_demo_data
from lmforge.data.preference import (
    PreferenceDataSection,
    PreferenceLoader,
    PreferencePair,
    load_preference_data,
    preference_pair,
    tokenize_pair,
)
from lmforge.data.sft import IGNORE_INDEX
from lmforge.data.tokenizer import EOT, train_bpe
from lmforge.errors import DataError, UserError

USER = {"role": "user", "content": "Where does Kalo live?"}
CHOSEN = {"role": "assistant", "content": "Kalo lives in Dunvale."}
REJECTED = {"role": "assistant", "content": "Kalo lives in Ostrel, I think."}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    return write_demo_data(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def tokenizer(demo, tmp_path_factory):
    return train_bpe([demo["corpus"]], vocab_size=400, out_dir=tmp_path_factory.mktemp("tok"))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def load(tmp_path, tokenizer, rows, **settings):
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    return load_preference_data(PreferenceDataSection(path=str(path), **settings), tokenizer)


def labelled_text(tokenizer, labels: np.ndarray) -> str:
    return tokenizer.decode(labels[labels != IGNORE_INDEX])


def pair(record: dict) -> PreferencePair:
    return preference_pair(record, PreferenceDataSection())


def test_text_pair_labels_only_the_responses(tmp_path, tokenizer):
    row = {"prompt": USER["content"], "chosen": CHOSEN["content"], "rejected": REJECTED["content"]}
    sample = load(tmp_path, tokenizer, [row]).samples[0]
    prompt_ids = tokenizer.encode_chat([USER], add_generation_prompt=True)
    for response, inputs, labels in (
        (CHOSEN, sample.chosen_inputs, sample.chosen_labels),
        (REJECTED, sample.rejected_inputs, sample.rejected_labels),
    ):
        full = tokenizer.encode_chat([USER, response])
        assert inputs.tolist() == full[:-1] and inputs[: len(prompt_ids)].tolist() == prompt_ids
        assert labelled_text(tokenizer, labels) == response["content"] + EOT
        # Masked exactly up to the end of the prompt (labels are shifted by one).
        assert (labels[: len(prompt_ids) - 1] == IGNORE_INDEX).all()
        assert (labels[len(prompt_ids) - 1 :] != IGNORE_INDEX).all()


def test_chat_prompt_with_earlier_assistant_turns_is_masked(tokenizer):
    history = [
        {"role": "system", "content": "Be brief."},
        USER,
        {"role": "assistant", "content": "Dunvale."},
        {"role": "user", "content": "And his pet?"},
    ]
    record = {
        "prompt": history,
        "chosen": {"role": "assistant", "content": "A heron."},
        "rejected": [{"role": "assistant", "content": "A goat."}],
    }
    sample, truncated = tokenize_pair(tokenizer, pair(record), max_seq_len=256)
    assert not truncated
    assert labelled_text(tokenizer, sample.chosen_labels) == "A heron." + EOT
    assert labelled_text(tokenizer, sample.rejected_labels) == "A goat." + EOT


def test_shared_prefix_conversations_are_split_like_hh(tokenizer):
    history = [
        USER,
        {"role": "assistant", "content": "Dunvale."},
        {"role": "user", "content": "Pet?"},
    ]
    hh = pair(
        {
            "chosen": [*history, {"role": "assistant", "content": "A heron."}],
            "rejected": [*history, {"role": "assistant", "content": "A goat."}],
        }
    )
    assert hh == PreferencePair(
        history,
        [{"role": "assistant", "content": "A heron."}],
        [{"role": "assistant", "content": "A goat."}],
    )
    # UltraFeedback binarized: a text prompt, and conversations that repeat it.
    ultra = pair(
        {"prompt": USER["content"], "chosen": [USER, CHOSEN], "rejected": [USER, REJECTED]}
    )
    assert ultra == PreferencePair([USER], [CHOSEN], [REJECTED])
    text = pair(
        {"prompt": USER["content"], "chosen": CHOSEN["content"], "rejected": REJECTED["content"]}
    )
    assert ultra == text
    a, _ = tokenize_pair(tokenizer, ultra, max_seq_len=256)
    b, _ = tokenize_pair(tokenizer, text, max_seq_len=256)
    assert all(
        np.array_equal(x, y)
        for x, y in zip(vars(a).values(), vars(b).values())
        if isinstance(x, np.ndarray)
    )


def test_demo_pairs_load(demo, tokenizer):
    data = load_preference_data(PreferenceDataSection(path=str(demo["dpo_train"])), tokenizer)
    assert len(data.samples) == data.num_rows > 0 and data.num_truncated == 0
    row = json.loads(demo["dpo_train"].read_text().splitlines()[0])
    assert labelled_text(tokenizer, data.samples[0].chosen_labels) == row["chosen"] + EOT


def test_truncation_cuts_responses_first_then_the_prompt_from_the_left(tokenizer):
    long_prompt = " ".join(["Where does Kalo live?"] * 12)
    long_answer = " ".join(["Kalo lives in Dunvale."] * 12)
    prompt_ids = tokenizer.encode_chat(
        [{"role": "user", "content": long_prompt}], add_generation_prompt=True
    )

    def cut(prompt: str, chosen: str, max_seq_len: int):
        sample, truncated = tokenize_pair(
            tokenizer,
            pair({"prompt": prompt, "chosen": chosen, "rejected": "No."}),
            max_seq_len=max_seq_len,
        )
        assert truncated
        assert (
            len(sample.chosen_inputs) <= max_seq_len and len(sample.rejected_inputs) <= max_seq_len
        )
        return sample

    # 1. Only the response is cut, from its end; the prompt stays whole.
    short_ids = tokenizer.encode_chat([USER], add_generation_prompt=True)
    budget = 2 * len(short_ids)  # the prompt leaves len(short_ids) + 1 ids >= budget // 2
    sample = cut(USER["content"], long_answer, budget)
    assert sample.chosen_inputs[: len(short_ids)].tolist() == short_ids
    assert len(sample.chosen_inputs) == budget
    full = tokenizer.encode_chat([USER, {"role": "assistant", "content": long_answer}])
    assert sample.chosen_inputs.tolist() == full[:budget]
    assert sample.chosen_labels[-1] == full[budget]
    # 2. The prompt alone is too long: responses keep max_seq_len // 2 ids, the prompt loses its
    # start but keeps BOS, and both responses share the same cut prompt.
    sample = cut(long_prompt, long_answer, 40)
    assert len(sample.chosen_inputs) == 40
    assert int((sample.chosen_labels != IGNORE_INDEX).sum()) == 20
    assert sample.chosen_inputs[0] == tokenizer.bos_id
    kept_prompt = 40 + 1 - 20
    assert (
        sample.chosen_inputs[1:kept_prompt].tolist()
        == prompt_ids[len(prompt_ids) - kept_prompt + 1 :]
    )
    assert (
        sample.rejected_inputs[:kept_prompt].tolist() == sample.chosen_inputs[:kept_prompt].tolist()
    )
    assert labelled_text(tokenizer, sample.rejected_labels) == "No." + EOT


BAD_ROWS = [
    ({"prompt": "Q", "chosen": "A"}, "missing field 'rejected'"),
    ({"chosen": "A", "rejected": "B"}, "no prompt"),
    ({"prompt": "Q", "chosen": 3, "rejected": "B"}, "field 'chosen' is a number"),
    (
        {"chosen": [USER, CHOSEN], "rejected": [{"role": "user", "content": "Other?"}, REJECTED]},
        "share no leading messages",
    ),
    ({"chosen": [USER, CHOSEN], "rejected": [USER, CHOSEN]}, "no response after the prompt"),
    (
        {"chosen": [USER, CHOSEN, USER], "rejected": [USER, REJECTED, USER]},
        "assistant messages only",
    ),
    (
        {"prompt": [{"role": "robot", "content": "Q"}], "chosen": "A", "rejected": "B"},
        "unknown role 'robot'",
    ),
    ("just text", "expected an object"),
]


@pytest.mark.parametrize(("row", "reason"), BAD_ROWS)
def test_malformed_row_names_file_line_and_reason(tmp_path, tokenizer, row, reason):
    good = {"prompt": "Q", "chosen": "A", "rejected": "B"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, row, good])
    with pytest.raises(DataError) as err:
        load_preference_data(PreferenceDataSection(path=str(path)), tokenizer)
    message = str(err.value)
    assert message.startswith(f"{path}:2: ") and reason in message and "\n" not in message, message
    data = load_preference_data(
        PreferenceDataSection(path=str(path), skip_bad_rows=True, max_bad_fraction=0.5), tokenizer
    )
    assert (len(data.samples), data.num_bad_rows) == (2, 1)


def test_batches_pad_all_four_tensors_to_one_length(demo, tokenizer):
    cfg = PreferenceDataSection(path=str(demo["dpo_train"]), max_seq_len=96)
    data = load_preference_data(cfg, tokenizer)
    batch = next(
        PreferenceLoader.from_section(data.samples, cfg, tokenizer, micro_batch_size=4, seed=2)
    )
    assert set(batch) == {"chosen_inputs", "chosen_labels", "rejected_inputs", "rejected_labels"}
    shapes = {tuple(t.shape) for t in batch.values()}
    assert len(shapes) == 1 and all(t.dtype == torch.int64 for t in batch.values())
    both = torch.cat([batch["chosen_inputs"], batch["rejected_inputs"]])  # one [2b, s] forward
    assert both.shape[0] == 8
    for side in ("chosen", "rejected"):
        inputs, labels = batch[f"{side}_inputs"], batch[f"{side}_labels"]
        for row in range(4):
            text = labelled_text(tokenizer, labels[row].numpy())
            assert text.endswith(EOT) and text.count(EOT) == 1
            padding = inputs[row] == tokenizer.pad_id
            assert (labels[row][padding] == IGNORE_INDEX).all()
    fixed = PreferenceLoader(
        data.samples, micro_batch_size=2, max_seq_len=96, pad_to_max_seq_len=True
    )
    assert next(fixed)["chosen_inputs"].shape == (2, 96)


def test_loader_resumes_exactly_and_splits_ranks(demo, tokenizer):
    data = load_preference_data(PreferenceDataSection(path=str(demo["dpo_train"])), tokenizer)

    def make(**kw):
        return PreferenceLoader(
            data.samples, **{"micro_batch_size": 4, "max_seq_len": 2048, "seed": 3, **kw}
        )

    loader = make()
    batches = [next(loader) for _ in range(30)]
    resumed = make()
    probe = make()
    for _ in range(11):
        next(probe)
    resumed.load_state_dict(probe.state_dict())
    for expected in batches[11:]:
        got = next(resumed)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    ranks = [make(micro_batch_size=2, dp_rank=r, dp_size=2) for r in range(2)]
    single = make()
    for _ in range(5):
        a, b, both = ranks[0].next_items(), ranks[1].next_items(), single.next_items()
        assert not set(a) & set(b) and sorted(a + b) == sorted(both)
    with pytest.raises(UserError, match="cannot resume"):
        PreferenceLoader(
            data.samples[:-1], micro_batch_size=4, max_seq_len=2048, seed=3
        ).load_state_dict(loader.state_dict())
