"""SFT data: row formats and errors, assistant-only labels, truncation, packing equal to unpacked
per-sample losses, and the loader's order, rank slices and exact resume."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.api import build_model
from lmforge.config import load_config
from lmforge.data.demo import write_demo_data
from lmforge.data.pretrain import build_block_causal_mask
from lmforge.data.sft import (
    IGNORE_INDEX,
    SFTDataSection,
    SFTLoader,
    load_sft_data,
    tokenize_conversation,
)
from lmforge.data.tokenizer import EOT, load_tokenizer, train_bpe
from lmforge.errors import ConfigError, DataError, ModelFormatError, UserError
from tests.train_utils import small_args

MULTI_TURN = [
    {"role": "system", "content": "You answer questions about the demo world."},
    {"role": "user", "content": "Where does Kalo live?"},
    {"role": "assistant", "content": "Kalo lives in Dunvale."},
    {"role": "user", "content": "What pet does Kalo have?"},
    {"role": "assistant", "content": "  Kalo has a heron. "},
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, Path]:
    # Four people of three facts: 12 SFT rows, a whole number of batches of 4.
    return write_demo_data(tmp_path_factory.mktemp("demo"), num_sft_people=4)


@pytest.fixture(scope="module")
def tokenizer(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    return train_bpe([demo["corpus"]], vocab_size=400, out_dir=out)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def label_runs(tokenizer, labels: np.ndarray) -> list[str]:
    """Decoded text of each contiguous run of labelled positions."""
    runs, current = [], []
    for label in [*labels.tolist(), IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def load(tmp_path, tokenizer, rows, **settings):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    return load_sft_data(SFTDataSection(path=[str(path)], **settings), tokenizer)


# ----------------------------------------------------------------------------- labels


def test_multi_turn_labels_are_exactly_the_assistant_turns(tmp_path, tokenizer):
    sample = load(tmp_path, tokenizer, [{"messages": MULTI_TURN}]).samples[0]
    assert label_runs(tokenizer, sample.labels) == [
        "Kalo lives in Dunvale." + EOT,
        "Kalo has a heron." + EOT,  # the template strips content
    ]
    num_labels = int((sample.labels != IGNORE_INDEX).sum())
    expected = sum(len(tokenizer.encode(m["content"].strip())) + 1 for m in MULTI_TURN[2::2])
    assert num_labels == expected
    # Inputs are the whole rendered conversation but its last id; labels are the next ids.
    ids = tokenizer.encode_chat(MULTI_TURN)
    assert sample.inputs.tolist() == ids[:-1]
    trained = sample.labels != IGNORE_INDEX
    assert sample.labels[trained].tolist() == np.asarray(ids[1:])[trained].tolist()


def test_train_on_input_labels_every_next_token(tmp_path, tokenizer):
    sample = load(tmp_path, tokenizer, [{"messages": MULTI_TURN}], train_on_input=True).samples[0]
    ids = tokenizer.encode_chat(MULTI_TURN)
    assert sample.labels.tolist() == ids[1:]


@pytest.mark.parametrize(
    ("row", "user"),
    [
        (
            {"instruction": "Name a town.", "input": "In the demo.", "output": "Dunvale."},
            "Name a town.\n\nIn the demo.",
        ),
        ({"instruction": "Name a town.", "output": "Dunvale."}, "Name a town."),
        ({"instruction": "Name a town.", "input": "", "output": "Dunvale."}, "Name a town."),
        ({"instruction": "Name a town.", "input": None, "output": "Dunvale."}, "Name a town."),
    ],
)
def test_alpaca_with_and_without_input(tmp_path, tokenizer, row, user):
    sample = load(tmp_path, tokenizer, [row]).samples[0]
    expected = tokenizer.encode_chat(
        [{"role": "user", "content": user}, {"role": "assistant", "content": "Dunvale."}]
    )
    assert sample.inputs.tolist() == expected[:-1]
    assert label_runs(tokenizer, sample.labels) == ["Dunvale." + EOT]


def test_sharegpt_conversations_equal_the_same_chat_messages(tmp_path, tokenizer):
    turns = [("system", "Be brief."), ("human", "Name a town."), ("gpt", "Dunvale."),
             ("human", "Another?"), ("gpt", "Penwick.")]  # fmt: skip
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    sharegpt = {"conversations": [{"from": f, "value": v} for f, v in turns]}
    chat = {"messages": [{"role": roles[f], "content": v} for f, v in turns]}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours = load(tmp_path / "a", tokenizer, [sharegpt]).samples[0]
    reference = load(tmp_path / "b", tokenizer, [chat]).samples[0]
    assert ours.inputs.tolist() == reference.inputs.tolist()
    assert ours.labels.tolist() == reference.labels.tolist()
    assert label_runs(tokenizer, ours.labels) == ["Dunvale." + EOT, "Penwick." + EOT]


def test_prompt_completion_text_is_one_user_and_one_assistant_message(tmp_path, tokenizer):
    # As Alpaca rows: the prompt is the user turn, the completion (with its end of turn) trained.
    row = {"prompt": "Name a town.", "completion": "Dunvale."}
    sample = load(tmp_path, tokenizer, [row]).samples[0]
    ids = tokenizer.encode_chat(
        [{"role": "user", "content": "Name a town."}, {"role": "assistant", "content": "Dunvale."}]
    )
    prompt_len = len(
        tokenizer.encode_chat(
            [{"role": "user", "content": "Name a town."}], add_generation_prompt=True
        )
    )
    assert sample.inputs.tolist() == ids[:-1]
    # Exactly the completion's ids are labels, each the next id.
    expected = np.full(len(ids) - 1, IGNORE_INDEX)
    expected[prompt_len - 1 :] = ids[prompt_len:]
    assert sample.labels.tolist() == expected.tolist()
    assert label_runs(tokenizer, sample.labels) == ["Dunvale." + EOT]


def test_conversational_prompt_completion_trains_only_the_completion(tmp_path, tokenizer):
    # The prompt's own assistant turn is context; the row renders as the whole conversation.
    prompt, completion = MULTI_TURN[:4], MULTI_TURN[4:]
    row = {"prompt": prompt, "completion": completion}
    sample = load(tmp_path, tokenizer, [row]).samples[0]
    ids = tokenizer.encode_chat(MULTI_TURN)
    prompt_len = len(tokenizer.encode_chat(prompt, add_generation_prompt=True))
    expected = np.full(len(ids) - 1, IGNORE_INDEX)
    expected[prompt_len - 1 :] = ids[prompt_len:]
    assert sample.inputs.tolist() == ids[:-1]
    assert sample.labels.tolist() == expected.tolist()
    assert label_runs(tokenizer, sample.labels) == ["Kalo has a heron." + EOT]
    # The same rows as chat messages train both assistant turns; train_on_input trains all.
    (tmp_path / "chat").mkdir()
    chat = load(tmp_path / "chat", tokenizer, [{"messages": MULTI_TURN}]).samples[0]
    assert chat.inputs.tolist() == sample.inputs.tolist()
    assert len(label_runs(tokenizer, chat.labels)) == 2
    (tmp_path / "all").mkdir()
    every = load(tmp_path / "all", tokenizer, [row], train_on_input=True).samples[0]
    assert every.labels.tolist() == ids[1:]


def test_prompt_completion_custom_fields_and_forced_format(tmp_path, tokenizer):
    rows = [{"q": "Say hi.", "a": "Hi.", "instruction": "ignored in prompt_completion format"}]
    data = load(
        tmp_path,
        tokenizer,
        rows,
        format="prompt_completion",
        prompt_field="q",
        completion_field="a",
    )
    assert label_runs(tokenizer, data.samples[0].labels) == ["Hi." + EOT]


def test_alpaca_custom_fields_and_forced_format(tmp_path, tokenizer):
    rows = [{"q": "Say hi.", "a": "Hi.", "messages": "ignored in alpaca format"}]
    data = load(tmp_path, tokenizer, rows, format="alpaca", instruction_field="q", output_field="a")
    assert label_runs(tokenizer, data.samples[0].labels) == ["Hi." + EOT]


def test_json_list_jsonl_gz_and_parquet_give_the_same_samples(tmp_path, tokenizer, demo):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in demo["sft_train"].read_text().splitlines()[:12]]
    rows[3] = {"messages": MULTI_TURN}
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=2))
    with gzip.open(tmp_path / "rows.jsonl.gz", "wt") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    results = []
    for name in ("rows.json", "rows.jsonl.gz", "rows.parquet"):
        cfg = SFTDataSection(path=str(tmp_path / name))
        results.append(
            [s.inputs.tolist() + s.labels.tolist() for s in load_sft_data(cfg, tokenizer).samples]
        )
    assert len(results[0]) == 12
    assert results[0] == results[1] == results[2]


def test_directory_input_reads_its_files_in_order(tmp_path, tokenizer):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", [{"instruction": "B", "output": "b"}])
    write_jsonl(folder / "a.jsonl", [{"instruction": "A", "output": "a"}])
    data = load_sft_data(SFTDataSection(path=str(folder)), tokenizer)
    assert [s.where for s in data.samples] == [f"{folder / 'a.jsonl'}:1", f"{folder / 'b.jsonl'}:1"]


# ----------------------------------------------------------------------------- malformed rows

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
BAD_ROWS = [
    ('{"messages": [', "invalid JSON"),
    ({"text": "no usable field"}, "no 'messages' field (chat), 'conversations' field"),
    ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown 'from' 'robot'"),
    ({"conversations": [{"value": "x"}]}, "not a ShareGPT turn"),
    ({"messages": []}, "empty list of messages"),
    ({"messages": "hello"}, "field 'messages' is a string"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": 3}]}, "has content a number"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "must end with an assistant"),
    ({"instruction": "x"}, "missing field 'output'"),
    ({"instruction": ["x"], "output": "y"}, "field 'instruction' is an array"),
    ([1, 2], "no 'messages' field (chat)"),
    ({"prompt": "x"}, "missing field 'completion' (fields: prompt)"),
    ({"completion": "y"}, "missing field 'prompt' (fields: completion)"),
    ({"prompt": "x", "completion": "  "}, "field 'completion' is empty"),
    ({"prompt": "", "completion": "y"}, "field 'prompt' is empty"),
    ({"prompt": 3, "completion": "y"}, "field 'prompt' is a number and 'completion' is a string"),
    ({"prompt": "x", "completion": [GOOD["messages"][1]]}, "give both as strings or both as"),
    ({"prompt": [], "completion": [GOOD["messages"][1]]}, "field 'prompt' is an empty list"),
    ({"prompt": GOOD["messages"][:1], "completion": [{"role": "assistant"}]}, "completion[0]"),
    (
        {"prompt": GOOD["messages"][:1], "completion": [{"role": "user", "content": "y"}]},
        "field 'completion' ends with a user message; it must end with an assistant message",
    ),
]


@pytest.mark.parametrize(("row", "reason"), BAD_ROWS)
def test_malformed_row_names_file_line_and_reason(tmp_path, tokenizer, row, reason):
    path = tmp_path / "rows.jsonl"
    bad = row if isinstance(row, str) else json.dumps(row)
    path.write_text(f"{json.dumps(GOOD)}\n\n{bad}\n{json.dumps(GOOD)}\n")
    with pytest.raises(DataError) as err:
        load_sft_data(SFTDataSection(path=str(path)), tokenizer)
    message = str(err.value)
    assert message.startswith(f"{path}:3: "), message
    assert reason in message and "\n" not in message


def test_json_list_errors_name_the_element_line(tmp_path, tokenizer):
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a"}\n]\n')
    with pytest.raises(DataError, match=rf"^{path}:3: missing field 'output'"):
        load_sft_data(SFTDataSection(path=str(path)), tokenizer)
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a",,}\n]\n')
    with pytest.raises(DataError, match=rf"^{path}:3: invalid JSON"):
        load_sft_data(SFTDataSection(path=str(path)), tokenizer)


def test_skip_bad_rows_counts_and_caps(tmp_path, tokenizer):
    rows = [GOOD] * 9 + [{"messages": []}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = load_sft_data(
        SFTDataSection(path=str(path), skip_bad_rows=True, max_bad_fraction=0.1), tokenizer
    )
    assert (len(data.samples), data.num_bad_rows, data.num_rows) == (9, 1, 10)
    with pytest.raises(DataError, match=rf"1 of 10 rows are malformed.*{path}:10: "):
        load_sft_data(
            SFTDataSection(path=str(path), skip_bad_rows=True, max_bad_fraction=0.05), tokenizer
        )


def test_source_errors_are_one_line_user_errors(tmp_path, tokenizer, monkeypatch):
    with pytest.raises(ConfigError, match="no training data"):
        load_sft_data(SFTDataSection(), tokenizer)
    with pytest.raises(DataError, match="no such file"):
        load_sft_data(SFTDataSection(path=str(tmp_path / "missing.jsonl")), tokenizer)
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="cannot tell the format"):
        load_sft_data(SFTDataSection(path=str(tmp_path / "rows.csv")), tokenizer)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(UserError) as err:
        load_sft_data(SFTDataSection(dataset="tatsu-lab/alpaca"), tokenizer)
    assert "pip install datasets" in str(err.value) and "local" in str(err.value)
    assert "\n" not in str(err.value)


def test_template_that_is_not_prefix_stable_is_refused(tokenizer, tmp_path):
    unstable = load_tokenizer(tokenizer.source)
    # Renders the last message differently from the same message followed by others.
    unstable.chat_template = (
        "{% for m in messages %}{% if loop.last %}<|start_header_id|>{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(ModelFormatError, match="not prefix-stable"):
        tokenize_conversation(unstable, MULTI_TURN)


def test_config_section_loads_from_a_file(tmp_path):
    path = tmp_path / "data.toml"
    path.write_text('path = "train.jsonl"\nformat = "chat"\nmax_seq_len = 512\npack = true\n')
    cfg = load_config(SFTDataSection, path)
    assert (cfg.path, cfg.format, cfg.max_seq_len, cfg.pack) == (["train.jsonl"], "chat", 512, True)
    path.write_text('format = "xml"\n')
    with pytest.raises(ConfigError, match="format"):
        load_config(SFTDataSection, path)


# ----------------------------------------------------------------------------- truncation


def test_truncation_keeps_the_start_and_drops_samples_without_labels(tmp_path, tokenizer):
    long_answer = " ".join(["Kalo lives in Dunvale."] * 20)
    rows = [
        {"instruction": "Where?", "output": long_answer},
        {"instruction": " ".join(["Where does Kalo live?"] * 20), "output": "Dunvale."},
        {"instruction": "Where?", "output": "Dunvale."},
    ]
    data = load(tmp_path, tokenizer, rows, max_seq_len=40)
    assert (data.num_truncated, data.num_dropped, len(data.samples)) == (2, 1, 2)
    cut, short = data.samples
    full = tokenizer.encode_chat(
        [{"role": "user", "content": "Where?"}, {"role": "assistant", "content": long_answer}]
    )
    assert cut.inputs.tolist() == full[:40]  # the first max_seq_len + 1 ids, cut from the end
    assert cut.labels[-1] == full[40] and len(short) < 40


# ----------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def demo_data(demo, tokenizer):
    return load_sft_data(SFTDataSection(path=str(demo["sft_train"]), max_seq_len=128), tokenizer)


def test_unpacked_batches_pad_to_the_longest_or_to_max_seq_len(demo_data):
    loader = SFTLoader(demo_data.samples, micro_batch_size=4, max_seq_len=128, pad_id=7)
    batch = next(loader)
    assert set(batch) == {"inputs", "labels"}
    lengths = [len(demo_data.samples[i]) for i in loader._permutations[0][:4]]
    assert batch["inputs"].shape == (4, max(lengths))
    for row, length in enumerate(lengths):
        assert (batch["inputs"][row, length:] == 7).all()
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all()
    fixed = SFTLoader(
        demo_data.samples, micro_batch_size=4, max_seq_len=128, pad_to_max_seq_len=True
    )
    assert next(fixed)["inputs"].shape == (4, 128)


def per_sample_losses(model, batch) -> list[float]:
    """Summed cross entropy of each document (packed) or row (unpacked), in order."""
    kwargs = {}
    if "document_ids" in batch:
        kwargs = {
            "positions": batch["positions"],
            "attn_mask": build_block_causal_mask(batch["document_ids"]),
        }
    logits = model(batch["inputs"], **kwargs)
    losses = F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(batch["labels"].shape)
    out = []
    for row in range(losses.shape[0]):
        if "document_ids" not in batch:
            out.append(losses[row].sum().item())
            continue
        ids = batch["document_ids"][row]
        labelled = batch["labels"][row] != IGNORE_INDEX
        for doc in ids.unique().tolist():
            if labelled[ids == doc].any():
                out.append(losses[row][ids == doc].sum().item())
    return out


@pytest.fixture
def one_thread():
    """Tiny matmuls run fastest on one thread, above all on a shared, busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_packing_gives_the_same_per_sample_losses_as_unpacked(demo_data, tokenizer, one_thread):
    samples = demo_data.samples[:10]
    args = small_args(tokenizer.vocab_size)
    model = build_model(args, seed=0).eval()
    packed = SFTLoader(samples, micro_batch_size=1, max_seq_len=128, pack=True, pad_id=3)
    assert packed.num_items < len(samples)  # several samples share a sequence
    unpacked = SFTLoader(samples, micro_batch_size=1, max_seq_len=128, pad_id=3)
    by_sample_packed, by_sample_unpacked = {}, {}
    with torch.no_grad():
        for _ in range(packed.num_items):
            (item,) = packed.next_items()
            losses = per_sample_losses(model, packed._collate([item]))
            by_sample_packed.update(zip(packed.packs[item], losses, strict=True))
        for _ in range(len(samples)):
            (item,) = unpacked.next_items()
            (loss,) = per_sample_losses(model, unpacked._collate([item]))
            by_sample_unpacked[item] = loss
    assert sorted(by_sample_packed) == list(range(len(samples)))
    for index in range(len(samples)):
        assert by_sample_packed[index] == pytest.approx(by_sample_unpacked[index], abs=1e-5)


def test_packed_batches_restart_positions_and_documents(demo_data):
    loader = SFTLoader(demo_data.samples, micro_batch_size=2, max_seq_len=128, pack=True)
    batch = next(loader)
    assert batch["document_ids"].dtype == torch.int32 and batch["positions"].dtype == torch.int64
    assert batch["inputs"].shape == batch["document_ids"].shape == (2, 128)
    for row in range(2):
        ids, positions = batch["document_ids"][row], batch["positions"][row]
        starts = torch.nonzero(torch.diff(ids, prepend=ids[:1] - 1)).flatten()
        assert (positions[starts] == 0).all()
        assert (torch.diff(positions)[torch.diff(ids) == 0] == 1).all()
    # Every sample appears in exactly one packed sequence.
    assert sorted(i for pack in loader.packs for i in pack) == list(range(len(demo_data.samples)))


# ----------------------------------------------------------------------------- loader order


def take(loader, num_batches):
    return [next(loader) for _ in range(num_batches)]


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("pack", [False, True])
def test_loader_is_deterministic_and_resumes_exactly(demo_data, pack):
    def make(**kw):
        settings = dict(micro_batch_size=3, max_seq_len=128, pack=pack, seed=5)
        return SFTLoader(demo_data.samples, **{**settings, **kw})

    first = take(make(), 40)  # crosses several epochs
    assert all(same(a, b) for a, b in zip(first, take(make(), 40), strict=True))
    assert not all(same(a, b) for a, b in zip(first, take(make(seed=6), 40), strict=True))
    loader = make()
    take(loader, 17)
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert all(same(a, b) for a, b in zip(first[17:], take(resumed, 23), strict=True))
    with pytest.raises(UserError, match="seed"):
        make(seed=6).load_state_dict(state)
    with pytest.raises(UserError, match="cannot resume the data order"):
        make(max_seq_len=100).load_state_dict(state)


def test_one_epoch_visits_every_sample_once(demo_data):
    loader = SFTLoader(demo_data.samples, micro_batch_size=4, max_seq_len=128)
    items = [i for _ in range(len(demo_data.samples) // 4) for i in loader.next_items()]
    assert sorted(items) == list(range(len(demo_data.samples)))


def test_dp_slices_are_disjoint_and_resume_under_another_dp_size(demo_data):
    def items(loader, steps):
        return [loader.next_items() for _ in range(steps)]

    single = SFTLoader(demo_data.samples, micro_batch_size=4, max_seq_len=128, seed=1)
    global_order = items(single, 6)  # 6 steps of 4
    ranks = [
        SFTLoader(
            demo_data.samples, micro_batch_size=2, max_seq_len=128, seed=1, dp_rank=r, dp_size=2
        )
        for r in range(2)
    ]
    per_rank = [items(r, 6) for r in ranks]
    for step in range(6):
        a, b = per_rank[0][step], per_rank[1][step]
        assert not set(a) & set(b)
        assert sorted(a + b) == sorted(global_order[step])
    # Resume the 2-rank state with one rank: continues from the same global item.
    state = ranks[0].state_dict()
    fresh = SFTLoader(demo_data.samples, micro_batch_size=4, max_seq_len=128, seed=1)
    expected = items(fresh, 7)[-1]
    again = SFTLoader(demo_data.samples, micro_batch_size=4, max_seq_len=128, seed=1)
    again.load_state_dict(state)
    assert again.next_items() == expected


def test_loader_from_section_uses_its_settings(demo_data, tokenizer):
    cfg = SFTDataSection(path="unused.jsonl", max_seq_len=128, pack=True)
    batch = next(
        SFTLoader.from_section(demo_data.samples, cfg, tokenizer, micro_batch_size=2, seed=3)
    )
    assert batch["inputs"].shape == (2, 128) and "document_ids" in batch
    cfg = SFTDataSection(path="unused.jsonl", max_seq_len=128)
    batch = next(
        SFTLoader.from_section(demo_data.samples, cfg, tokenizer, micro_batch_size=8, seed=3)
    )
    padding = batch["labels"] == IGNORE_INDEX
    padding[:, :-1] &= padding[:, 1:].clone()  # trailing runs only
    assert (batch["inputs"][:, -1:][padding[:, -1:]] == tokenizer.pad_id).all()


def test_a_chat_template_from_the_config_replaces_the_tokenizers(tmp_path, demo):
    from lmforge.config import ModelSection
    from lmforge.data.tokenizer import train_bpe
    from lmforge.errors import ConfigError
    from lmforge.train.stage import resolve_model

    tokenizer_dir = tmp_path / "tok"
    train_bpe([demo["corpus"]], vocab_size=400, out_dir=tokenizer_dir)
    template = (
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}"
        "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
        "<|end_header_id|>{% endif %}"
    )
    (tmp_path / "plain.jinja").write_text(template)
    section = ModelSection(
        tokenizer=str(tokenizer_dir), chat_template=str(tmp_path / "plain.jinja")
    )
    tokenizer = resolve_model(section).tokenizer
    assert tokenizer.chat_template == template
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}])
    assert rendered == "<|start_header_id|>user<|end_header_id|>Hi.<|eot_id|>"
    rows = [{"conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Yo."}]}]
    sample = load(tmp_path, tokenizer, rows).samples[0]
    assert label_runs(tokenizer, sample.labels) == ["Yo." + EOT]
    tokenizer.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == template
    with pytest.raises(ConfigError, match="does not parse"):
        resolve_model(ModelSection(tokenizer=str(tokenizer_dir), chat_template="{% for %}"))
