"""Tests for lmforge.data.tokenizer and the `lmforge tokenizer` CLI.

References: transformers' AutoTokenizer (loads what we save), tiktoken (a tiny hand-made rank
file) and our own Python chat renderer against the jinja template.
"""

from __future__ import annotations

import argparse
import base64
import json
import random

import pytest

from lmforge.commands import tokenizer as tokenizer_cmd
from lmforge.data.tokenizer import (
    LLAMA3_CHAT_TEMPLATE,
    LLAMA3_SPECIAL_TOKENS,
    TRAIN_SPECIAL_TOKENS,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    _cut_long_runs,
    load_tokenizer,
    render_llama3_chat,
    train_bpe,
)
from lmforge.errors import ConfigError, DataError, ModelFormatError, UserError

WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "tokenizer", "llama"),
    *("hello", "world", "café", "naïve", "東京", "数据", "🙂", "don't", "it's", "I'll"),
    *("12345", "3.14", "foo_bar", "print(x)", "{key: value}", "<html>", "tab\there"),
]
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ven", "dar", "ex", "ion", "st")

SAMPLE_TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\nline five\r\n",
    "numbers 1234567 and 3.14159, unicode: café 東京 🙂🙃",
    "code:\n    def f(x):\n        return x**2  # square\n",
    "special text <|eot_id|> and <|begin_of_text|> must stay text",
    "",
    " ",
    "\t\t\n",
]
# transformers parses special-token text anywhere in its input; compare on text without any.
PLAIN_TEXTS = [text for text in SAMPLE_TEXTS if "<|" not in text]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  What is 2+2?\n"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the llama cross the road?\n\nTo get tokenized."},
        {"role": "user", "content": "Another, with unicode: 東京 🙂"},
        {"role": "assistant", "content": "  No.  "},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}],
        },
        {"role": "assistant", "content": None},
        {"role": "ipython", "content": '{"result": 42}'},
        {"role": "tool", "content": "ok"},
    ],
]


def _write_corpus(path, *, seed: int, num_lines: int = 3000) -> None:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [
            rng.choice(WORDS)
            if rng.random() < 0.5
            else "".join(rng.choices(SYLLABLES, k=rng.randint(1, 4)))
            for _ in range(rng.randint(3, 15))
        ]
        line = " ".join(words)
        lines.append(line + rng.choice([".", "!", "?", ",", ""]))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("bpe")
    _write_corpus(root / "a.txt", seed=0)
    _write_corpus(root / "b.txt", seed=1)
    return train_bpe([root / "a.txt", root / "b.txt"], vocab_size=600, out_dir=root / "tok")


@pytest.fixture(scope="module")
def auto_tokenizer(trained):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(trained.source))


# Hand-made tiktoken ranks: all 256 bytes, then merges, each made of two earlier tokens.
TINY_MERGES = [
    b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"in", b"ing",
    b"th", b"the", b" the", b"12", b"123", b"  ", b"\n\n", b"!!", b" t", b"er", b" ther",
]  # fmt: skip


def _tiny_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for token in TINY_MERGES:
        ranks[token] = len(ranks)
    return ranks


def _write_tiktoken_file(path) -> dict[bytes, int]:
    ranks = _tiny_ranks()
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="ascii")
    return ranks


@pytest.fixture()
def tiny_tiktoken_dir(tmp_path):
    _write_tiktoken_file(tmp_path / "model" / "original" / "tokenizer.model")
    return tmp_path / "model"


# --- chat format ------------------------------------------------------------------------------


def test_render_llama3_chat_exact_format():
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Hi"},
    ]
    assert render_llama3_chat(messages, add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_parity_python_jinja_transformers(
    trained, auto_tokenizer, add_generation_prompt
):
    assert trained.chat_template == LLAMA3_CHAT_TEMPLATE
    for messages in CONVERSATIONS:
        expected = render_llama3_chat(messages, add_generation_prompt=add_generation_prompt)
        ours = trained.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = auto_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == expected
        assert theirs == expected


def test_encode_chat_matches_transformers(trained, auto_tokenizer):
    messages = CONVERSATIONS[1]
    ids = trained.encode_chat(messages, add_generation_prompt=True)
    theirs = auto_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(theirs, list):  # newer transformers return a BatchEncoding
        theirs = theirs["input_ids"]
    assert ids == list(theirs)
    assert ids[0] == trained.bos_id
    assert ids.count(trained.eot_id) == len(messages)
    assert trained.decode(ids) == render_llama3_chat(messages, add_generation_prompt=True)


def test_unknown_role_raises_data_error(trained):
    messages = [{"role": "robot", "content": "beep"}]
    with pytest.raises(DataError, match=r"'robot'.*system, user, assistant, ipython, tool"):
        render_llama3_chat(messages)
    with pytest.raises(DataError, match="robot"):
        trained.apply_chat_template(messages)
    with pytest.raises(DataError, match="message 0"):
        render_llama3_chat(["not a dict"])


# --- trained byte-level BPE -------------------------------------------------------------------


def test_train_bpe_layout_and_special_ids(trained):
    out = trained.source
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == LLAMA3_CHAT_TEMPLATE
    assert config["bos_token"] == "<|begin_of_text|>"
    assert config["eos_token"] == "<|end_of_text|>"
    assert isinstance(config["model_max_length"], int)

    assert isinstance(trained, HFTokenizer)
    assert trained.vocab_size == 600  # the corpus is big enough to fill it
    # Special tokens take the last ids, in the order given, as in Llama 3.
    first_special = trained.vocab_size - len(TRAIN_SPECIAL_TOKENS)
    assert trained.special_tokens == {
        name: first_special + i for i, name in enumerate(TRAIN_SPECIAL_TOKENS)
    }
    assert trained.bos_id == trained.special_tokens["<|begin_of_text|>"]
    assert trained.eos_id == trained.special_tokens["<|end_of_text|>"]
    assert trained.eot_id == trained.special_tokens["<|eot_id|>"]
    assert trained.pad_id == trained.special_tokens["<|finetune_right_pad_id|>"]
    assert trained.stop_ids == {trained.eos_id, trained.eot_id}
    assert trained.num_merges > 0
    # Every byte has a token of its own, so any text can be encoded.
    assert all(len(trained.encode(bytes([b]).decode("latin-1"))) <= 2 for b in range(256))
    assert len({trained.encode(chr(b))[0] for b in range(128)}) == 128


def test_round_trip_and_bos_eos(trained):
    for text in SAMPLE_TEXTS:
        ids = trained.encode(text)
        assert trained.decode(ids) == text
        assert all(0 <= i < trained.vocab_size for i in ids)
        assert trained.encode(text, bos=True, eos=True) == [trained.bos_id, *ids, trained.eos_id]
    assert trained.encode("hello world")[0] != trained.bos_id  # no automatic BOS
    assert trained.encode_batch(SAMPLE_TEXTS, bos=True) == [
        trained.encode(t, bos=True) for t in SAMPLE_TEXTS
    ]
    with_specials = trained.encode("x", bos=True, eos=True)
    assert trained.decode(with_specials, skip_special=True) == "x"


def test_special_token_text_is_not_parsed(trained):
    ids = trained.encode("a <|eot_id|> b <|begin_of_text|>")
    assert not set(ids) & set(trained.special_tokens.values())
    assert trained.decode(ids) == "a <|eot_id|> b <|begin_of_text|>"


def test_autotokenizer_parity(trained, auto_tokenizer):
    for text in PLAIN_TEXTS:
        ids = trained.encode(text)
        assert auto_tokenizer.encode(text, add_special_tokens=False) == ids
        # transformers' default adds BOS, as Llama 3's tokenizer and lmforge's data do
        assert auto_tokenizer(text)["input_ids"] == trained.encode(text, bos=True)
        assert trained.adds_bos
        assert auto_tokenizer.decode(ids) == trained.decode(ids)
    assert auto_tokenizer.bos_token_id == trained.bos_id
    assert auto_tokenizer.eos_token_id == trained.eos_id
    assert auto_tokenizer.pad_token_id == trained.pad_id
    assert len(auto_tokenizer) == trained.vocab_size


def test_fingerprint_stable_across_save_and_load(trained, tmp_path):
    fingerprint = trained.fingerprint()
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0
    assert load_tokenizer(trained.source).fingerprint() == fingerprint
    trained.save(tmp_path / "copy")
    copy = load_tokenizer(tmp_path / "copy")
    assert copy.fingerprint() == fingerprint
    assert copy.encode("hello world") == trained.encode("hello world")
    assert copy.chat_template == trained.chat_template


def test_fingerprint_differs_for_another_tokenizer(trained, tmp_path):
    _write_corpus(tmp_path / "c.txt", seed=7)
    other = train_bpe([tmp_path / "c.txt"], vocab_size=500, out_dir=tmp_path / "other")
    assert other.fingerprint() != trained.fingerprint()


def test_train_bpe_errors(tmp_path):
    _write_corpus(tmp_path / "ok.txt", seed=3, num_lines=10)
    with pytest.raises(ConfigError, match="vocab_size 100"):
        train_bpe([tmp_path / "ok.txt"], vocab_size=100, out_dir=tmp_path / "o1")
    with pytest.raises(DataError, match=r"missing\.txt"):
        train_bpe([tmp_path / "missing.txt"], vocab_size=400, out_dir=tmp_path / "o2")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(DataError, match=r"latin1\.txt.*UTF-8"):
        train_bpe([tmp_path / "latin1.txt"], vocab_size=400, out_dir=tmp_path / "o3")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="no text"):
        train_bpe([tmp_path / "empty.txt"], vocab_size=400, out_dir=tmp_path / "o4")


# --- tiktoken backend -------------------------------------------------------------------------


def test_tiktoken_backend(tiny_tiktoken_dir):
    ranks = _tiny_ranks()
    num_base = len(ranks)
    for path in (tiny_tiktoken_dir, tiny_tiktoken_dir / "original" / "tokenizer.model"):
        tok = load_tokenizer(path)
        assert isinstance(tok, TiktokenTokenizer)
        assert tok.vocab_size == num_base + 256
        assert tok.special_tokens == {n: num_base + i for i, n in enumerate(LLAMA3_SPECIAL_TOKENS)}
        assert tok.bos_id == num_base and tok.eos_id == num_base + 1
        assert tok.eot_id == num_base + 9 and tok.pad_id == num_base + 4
        assert tok.stop_ids == {num_base + 1, num_base + 8, num_base + 9}  # eos, eom, eot
        assert tok.chat_template == LLAMA3_CHAT_TEMPLATE

    assert tok.encode("hello world", bos=True) == [tok.bos_id, ranks[b"hello"], ranks[b" world"]]
    assert tok.encode("thing") == [ranks[b"th"], ranks[b"ing"]]
    for text in SAMPLE_TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(SAMPLE_TEXTS) == [tok.encode(t) for t in SAMPLE_TEXTS]
    assert tok.eot_id not in tok.encode("<|eot_id|>")

    messages = CONVERSATIONS[1]
    ids = tok.encode_chat(messages, add_generation_prompt=True)
    assert ids[0] == tok.bos_id and ids.count(tok.eot_id) == len(messages)
    assert tok.decode(ids) == render_llama3_chat(messages, add_generation_prompt=True)
    assert "<|eot_id|>" not in tok.decode(ids, skip_special=True)


def test_both_backends_pickle_with_their_chat_template(trained, tiny_tiktoken_dir):
    """`lmforge serve` sends the tokenizer to its HTTP process: a copy encodes text and chats
    as the original does (the compiled template stays behind and is compiled again)."""
    import pickle

    messages = CONVERSATIONS[1]
    for tok in (trained, load_tokenizer(tiny_tiktoken_dir)):
        chat = tok.encode_chat(messages, add_generation_prompt=True)  # compiles the template
        copy = pickle.loads(pickle.dumps(tok))
        assert type(copy) is type(tok)
        assert [copy.encode(t) for t in SAMPLE_TEXTS] == [tok.encode(t) for t in SAMPLE_TEXTS]
        assert copy.encode_chat(messages, add_generation_prompt=True) == chat
        assert copy.stop_ids == tok.stop_ids and copy.chat_template == tok.chat_template


def test_tiktoken_save_converts_to_tokenizer_json(tiny_tiktoken_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    tik = load_tokenizer(tiny_tiktoken_dir)
    tik.save(tmp_path / "converted")
    assert (tmp_path / "converted" / "original" / "tokenizer.model").is_file()
    hf = load_tokenizer(tmp_path / "converted")
    assert isinstance(hf, HFTokenizer)
    assert hf.fingerprint() == tik.fingerprint()
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.eot_id, hf.stop_ids) == (
        tik.vocab_size,
        tik.bos_id,
        tik.eos_id,
        tik.eot_id,
        tik.stop_ids,
    )
    assert load_tokenizer(tmp_path / "converted" / "original").fingerprint() == tik.fingerprint()
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "converted"))
    rng = random.Random(0)
    texts = PLAIN_TEXTS + [
        "".join(rng.choice(["hello", " world", "the", " there", "ing", "12345", "  ", "\n\n", "!!!"])
                for _ in range(30))
        for _ in range(20)
    ]  # fmt: skip
    for text in texts:
        ids = tik.encode(text)
        assert hf.encode(text) == ids, text
        assert auto.encode(text, add_special_tokens=False) == ids, text
    chat = CONVERSATIONS[2]
    assert hf.encode_chat(chat) == tik.encode_chat(chat)


def test_cut_long_runs_keeps_text():
    text = "a" * 60_000 + " " * 30_000 + "b c"
    pieces = _cut_long_runs(text)
    assert "".join(pieces) == text
    assert [len(p) for p in pieces] == [25_000, 25_000, 35_000, 5_003]
    assert _cut_long_runs("short text") == ["short text"]


# --- errors -----------------------------------------------------------------------------------


def test_load_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelFormatError, match=str(missing)):
        load_tokenizer(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match=r"empty.*no tokenizer found"):
        load_tokenizer(tmp_path / "empty")

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "tokenizer.json").write_text("{ this is not json")
    with pytest.raises(ModelFormatError, match=r"garbage/tokenizer\.json"):
        load_tokenizer(garbage)

    spm = tmp_path / "spm"
    (spm / "original").mkdir(parents=True)
    (spm / "original" / "tokenizer.model").write_bytes(
        b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02"
    )
    with pytest.raises(ModelFormatError, match=r"spm/original/tokenizer\.model:\d+.*SentencePiece"):
        load_tokenizer(spm)

    holes = tmp_path / "holes.model"
    holes.write_text("aGk= 0\n")  # only "hi": ranks fine, single bytes missing
    with pytest.raises(ModelFormatError, match=r"holes\.model.*single-byte"):
        load_tokenizer(holes)
    assert issubclass(ModelFormatError, UserError)


def test_bad_tokenizer_config_is_model_format_error(trained, tmp_path):
    trained.save(tmp_path / "t")
    (tmp_path / "t" / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ModelFormatError, match=r"tokenizer_config\.json.*not valid JSON"):
        load_tokenizer(tmp_path / "t")


# --- CLI --------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lmforge")
    tokenizer_cmd.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_train_and_encode(tmp_path, capsys):
    _write_corpus(tmp_path / "corpus.txt", seed=5, num_lines=800)
    out = tmp_path / "tok"
    args = _parse(
        ["tokenizer", "train", "--input", str(tmp_path / "corpus.txt"), "--vocab-size", "400",
         "--out", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0
    report = capsys.readouterr().out
    assert "vocab size: 400" in report and "merges:" in report and str(out) in report

    args = _parse(["tokenizer", "encode", str(out), "hello world", "--bos"])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    tok = load_tokenizer(out)
    assert printed == tok.encode("hello world", bos=True)

    args = _parse(["tokenizer", "info", str(out)])
    assert args.func(args) == 0
    assert f"fingerprint: {tok.fingerprint()}" in capsys.readouterr().out

    args = _parse(["tokenizer", "encode", str(tmp_path / "missing"), "x"])
    with pytest.raises(ModelFormatError, match="missing"):
        args.func(args)


def test_cli_help_texts(capsys):
    for argv in (["tokenizer", "--help"], ["tokenizer", "train", "--help"],
                 ["tokenizer", "encode", "--help"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            _parse(argv)
        assert exit_info.value.code == 0
    assert "SOURCE" in capsys.readouterr().out


def test_cli_main_turns_user_error_into_exit_code_2(tmp_path, monkeypatch, capsys):
    from lmforge import cli
    from lmforge.commands import tokenizer

    monkeypatch.setattr(cli, "COMMAND_MODULES", [tokenizer])
    assert cli.main(["tokenizer", "encode", str(tmp_path / "missing"), "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "missing" in err and "\n" not in err
