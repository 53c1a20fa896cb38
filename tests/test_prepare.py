"""`lmforge prepare`: shards equal direct tokenization, worker-independence, malformed rows,
optional readers (parquet, hub datasets) and the CLI."""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from lmforge import cli
from lmforge.data import prepare as prepare_module
from lmforge.data.prepare import PrepareSection, prepare, token_dtype
from lmforge.data.pretrain import TokenShards
from lmforge.data.tokenizer import (
    BEGIN_OF_TEXT,
    END_OF_TEXT,
    HFTokenizer,
    load_tokenizer,
    train_bpe,
)
from lmforge.errors import ConfigError, DataError, UserError

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "data",
    "flows",
    "into",
    "token",
    "shards",
]


def random_docs(num_docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) + rng.choice([".", "!"])
        for _ in range(num_docs)
    ]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    (root / "corpus.txt").write_text("\n".join(random_docs(400, seed=1)), encoding="utf-8")
    train_bpe([root / "corpus.txt"], vocab_size=512, out_dir=root / "tokenizer")
    return root / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def expected_stream(tokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The token stream and document starts that prepare must write for `docs`."""
    ids = [tokenizer.encode(doc, bos=True, eos=True) for doc in docs]
    lengths = [len(i) for i in ids]
    return np.concatenate([np.array(i, dtype=np.int64) for i in ids]), np.cumsum([0, *lengths[:-1]])


def run(tmp_path: Path, tokenizer_dir: Path, inputs, name: str = "out", **settings):
    cfg = PrepareSection(
        input=[str(i) for i in inputs], tokenizer=str(tokenizer_dir), out=str(tmp_path / name)
    )
    for key, value in {"workers": 1, **settings}.items():
        setattr(cfg, key, value)
    return prepare(cfg, progress=False)


def test_shards_equal_direct_tokenization(tmp_path, tokenizer_dir, tokenizer):
    docs = random_docs(60)
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    (tmp_path / "b.txt").write_text("a whole file\n\nis one document\n", encoding="utf-8")
    result = run(tmp_path, tokenizer_dir, [jsonl, tmp_path / "b.txt"], shard_tokens=333)

    all_docs = [*docs, "a whole file\n\nis one document\n"]
    stream, doc_starts = expected_stream(tokenizer, all_docs)
    shards = TokenShards(result.out_dir)
    assert shards.num_tokens == result.num_tokens == stream.size
    assert np.array_equal(shards.read(0, shards.num_tokens), stream)
    assert np.array_equal(shards.doc_starts, doc_starts)
    assert shards.num_documents == result.num_documents == len(all_docs)

    index = json.loads((result.out_dir / "index.json").read_text())
    assert [s["num_tokens"] for s in index["shards"]][:-1] == [333] * (len(index["shards"]) - 1)
    assert (result.out_dir / "tokens-00000.bin").stat().st_size == 333 * 2
    meta = json.loads((result.out_dir / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tokenizer.vocab_size
    assert (meta["eos_id"], meta["bos_id"]) == (tokenizer.eos_id, tokenizer.bos_id)
    assert meta["tokenizer_fingerprint"] == tokenizer.fingerprint()
    assert meta["num_tokens"] == stream.size and meta["num_bad_rows"] == 0
    assert [s["num_documents"] for s in meta["sources"]] == [60, 1]
    assert not list(tmp_path.glob(".out.partial-*"))


def test_text_paragraphs(tmp_path, tokenizer_dir, tokenizer):
    text = "first paragraph\nstill first\n\n\nsecond one\n  \nthird\n"
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    result = run(tmp_path, tokenizer_dir, [tmp_path / "p.txt"], text_split="paragraph")
    stream, _ = expected_stream(tokenizer, ["first paragraph\nstill first", "second one", "third"])
    shards = TokenShards(result.out_dir)
    assert np.array_equal(shards.read(0, shards.num_tokens), stream)


def big_vocab_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer whose BOS/EOS ids are above 65535 (70,000 filler entries)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    vocab.update({f"<filler{i}>": len(vocab) + i for i in range(70_000)})
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True) for t in (BEGIN_OF_TEXT, END_OF_TEXT)])
    config = {"bos_token": BEGIN_OF_TEXT, "eos_token": END_OF_TEXT}
    HFTokenizer(hf, config=config).save(directory)
    return directory


def test_uint16_or_uint32_by_vocab_size(tmp_path):
    assert token_dtype(65536) == np.dtype("<u2") and token_dtype(65537) == np.dtype("<u4")
    tok_dir = big_vocab_tokenizer(tmp_path / "bigtok")
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"text": "hi there"}, {"text": "ok"}])
    result = run(tmp_path, tok_dir, [jsonl])
    shards = TokenShards(result.out_dir)
    assert result.dtype == "uint32" and shards.dtype == np.dtype("<u4")
    stream = shards.read(0, shards.num_tokens)
    assert (result.out_dir / "tokens-00000.bin").stat().st_size == 4 * stream.size
    assert stream[0] == shards.bos_id > 65535 and stream[-1] == shards.eos_id > 65535
    assert (
        stream.tolist() == expected_stream(load_tokenizer(tok_dir), ["hi there", "ok"])[0].tolist()
    )


def test_workers_do_not_change_the_output(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(prepare_module, "_CHUNK_DOCS", 7)  # many chunks for two workers
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in random_docs(150, seed=5)])
    one = run(tmp_path, tokenizer_dir, [jsonl], name="one", workers=1, shard_tokens=500)
    two = run(tmp_path, tokenizer_dir, [jsonl], name="two", workers=2, shard_tokens=500)
    names = sorted(p.name for p in one.out_dir.iterdir())
    assert names == sorted(p.name for p in two.out_dir.iterdir())
    assert len([n for n in names if n.startswith("tokens-")]) > 2
    for name in names:
        if name != "meta.json":
            assert (one.out_dir / name).read_bytes() == (two.out_dir / name).read_bytes(), name
    meta_one, meta_two = (json.loads((r.out_dir / "meta.json").read_text()) for r in (one, two))
    meta_one.pop("created"), meta_two.pop("created")
    assert meta_one == meta_two


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"text": "unterminated', "invalid JSON"),
        ('{"body": "no text field"}', "missing field 'text' (fields: body)"),
        ('{"text": 42}', "field 'text' is a number, expected a string"),
        ('{"text": null}', "field 'text' is null, expected a string"),
        ('["text"]', "expected a JSON object"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, tokenizer_dir, line, reason):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "good"}\n\n{"text": "also good"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError) as info:
        run(tmp_path, tokenizer_dir, [path])
    message = str(info.value)
    assert message.startswith(f"{path}:4: ") and reason in message
    assert "--skip-bad-rows" in message and "\n" not in message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_skip_bad_rows_counts_and_caps(tmp_path, tokenizer_dir, caplog):
    records: list = [{"text": d} for d in random_docs(100)]
    records[10] = {"txt": "wrong field"}
    path = write_jsonl(tmp_path / "rows.jsonl", records)
    result = run(tmp_path, tokenizer_dir, [path], skip_bad_rows=True)
    assert (result.num_bad_rows, result.num_documents, result.num_rows) == (1, 99, 100)
    assert json.loads((result.out_dir / "meta.json").read_text())["num_bad_rows"] == 1
    assert f"{path}:11: missing field 'text'" in caplog.text

    records[20] = {"text": ["a", "list"]}
    path = write_jsonl(tmp_path / "rows.jsonl", records)
    with pytest.raises(DataError) as info:
        run(tmp_path, tokenizer_dir, [path], name="capped", skip_bad_rows=True)
    assert "2 of 100 rows" in str(info.value) and "max_bad_fraction=0.01" in str(info.value)
    assert f"{path}:11" in str(info.value)
    assert not (tmp_path / "capped").exists()
    run(tmp_path, tokenizer_dir, [path], name="allowed", skip_bad_rows=True, max_bad_fraction=0.02)


def test_empty_and_missing_inputs(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(DataError, match=r"no documents in .*: 2 rows, 2 empty"):
        run(tmp_path, tokenizer_dir, [path])
    with pytest.raises(DataError, match="no such file"):
        run(tmp_path, tokenizer_dir, [tmp_path / "missing.jsonl"])
    (tmp_path / "notes.csv").write_text("x\n")
    with pytest.raises(DataError, match="--format"):
        run(tmp_path, tokenizer_dir, [tmp_path / "notes.csv"])
    with pytest.raises(ConfigError, match="input files"):
        run(tmp_path, tokenizer_dir, [])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(UserError, match="already exists"):
        run(tmp_path, tokenizer_dir, [tmp_path / "notes.csv"], name="taken", format="text")


def test_parquet(tmp_path, tokenizer_dir, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["one doc", None, "two docs"], "n": [1, 2, 3]}), path)
    settings = dict(text_field="body", skip_bad_rows=True, max_bad_fraction=0.5)
    result = run(tmp_path, tokenizer_dir, [path], **settings)
    shards = TokenShards(result.out_dir)
    stream, _ = expected_stream(tokenizer, ["one doc", "two docs"])
    assert np.array_equal(shards.read(0, shards.num_tokens), stream)
    with pytest.raises(DataError, match=rf"{path}:2: field 'body' is null"):
        run(tmp_path, tokenizer_dir, [path], name="strict", text_field="body")
    with pytest.raises(DataError, match="no column 'text'"):
        run(tmp_path, tokenizer_dir, [path], name="nocol")
    with pytest.raises(DataError, match="type int64"):
        run(tmp_path, tokenizer_dir, [path], name="int", text_field="n")


def test_parquet_without_pyarrow(tmp_path, tokenizer_dir, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match="pip install pyarrow"):
        run(tmp_path, tokenizer_dir, [tmp_path / "t.parquet"])


def test_hub_dataset(tmp_path, tokenizer_dir, tokenizer, monkeypatch):
    def unreachable(name, config=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    fake = types.ModuleType("datasets")
    fake.load_dataset = unreachable
    monkeypatch.setitem(sys.modules, "datasets", fake)
    cfg = PrepareSection(
        dataset="wikitext", tokenizer=str(tokenizer_dir), out=str(tmp_path / "o"), workers=1
    )
    with pytest.raises(DataError) as info:
        prepare(cfg, progress=False)
    assert "cannot reach the Hugging Face hub" in str(info.value)
    assert "--input" in str(info.value) and "\n" not in str(info.value)

    class Rows(list):
        column_names = ("text",)

    fake.load_dataset = lambda name, config=None, split=None: Rows(
        [{"text": "hub doc"}, {"text": 3}]
    )
    with pytest.raises(DataError, match=r"wikitext\[train\]:2: field 'text' is a number"):
        prepare(cfg, progress=False)
    cfg.skip_bad_rows, cfg.max_bad_fraction = True, 0.5
    result = prepare(cfg, progress=False)
    assert result.num_documents == 1 and result.num_bad_rows == 1

    monkeypatch.setitem(sys.modules, "datasets", None)
    cfg.out = str(tmp_path / "o2")
    with pytest.raises(UserError, match="pip install datasets"):
        prepare(cfg, progress=False)


def test_cli_flags_config_and_errors(tmp_path, tokenizer_dir, tokenizer, capsys):
    path = write_jsonl(tmp_path / "a.jsonl", [{"body": "cli doc"}])
    out = tmp_path / "cli"
    argv = ["prepare", "--input", str(path), "--tokenizer", str(tokenizer_dir), "--out", str(out)]
    code = cli.main([*argv, "--text-field", "body", "shard_tokens=1000", "workers=1"])
    assert code == 0 and "from 1 document in 1 shard" in capsys.readouterr().out
    assert np.array_equal(
        TokenShards(out).read(0, TokenShards(out).num_tokens),
        expected_stream(tokenizer, ["cli doc"])[0],
    )

    config = tmp_path / "prepare.toml"
    config.write_text(
        f'input = ["{path}"]\ntokenizer = "{tokenizer_dir}"\nout = "{tmp_path / "cfg"}"\n'
        'text_field = "body"\nworkers = 1\n'
    )
    assert cli.main(["prepare", "--config", str(config)]) == 0
    assert (tmp_path / "cfg" / "meta.json").is_file()

    code = cli.main([*argv[:-1], str(tmp_path / "strict"), "workers=1"])  # field "text" missing
    assert code == 2
    assert f"{path}:1: missing field 'text'" in capsys.readouterr().err
    code = cli.main(["prepare", "--config", str(config), "--out", str(tmp_path / "x"), "wrkers=2"])
    assert code == 2 and "did you mean 'workers'" in capsys.readouterr().err
