"""Hub ids as `model.source` (and wherever a model is named) against the fake hub of
tests/fake_hub.py: shape-only commands fetch the config alone, the first command that reads
weights downloads the model into `$HF_HOME/lmforge/models/`, later ones use that copy without a
request (offline too), and an unreachable or refusing hub is one line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.api import build_model, save_state
from tests.fake_hub import REPO, TOKEN, FakeHub, hub_env
from tests.train_utils import demo_world

CLI = "import sys, lmforge.cli as cli; sys.exit(cli.main(sys.argv[1:]))"
# Weights lmforge never reads, which the cache must leave on the hub.
UNREAD = {"original/consolidated.00.pth": b"\x02" * 5000, "pytorch_model.bin": b"\x03" * 5000}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(repo files of a small random model with the demo tokenizer, the demo data paths)."""
    root = tmp_path_factory.mktemp("hub-model")
    paths, tokenizer, args = demo_world(root, vocab_size=400)
    base = save_state(
        build_model(args, seed=1).state_dict(),
        args,
        tokenizer,
        root / "base",
        stage="test",
        parent=None,
    )
    files = {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}
    return {**files, **UNREAD}, paths


def lmforge(args: list[str], *, hub: FakeHub, hf_home: Path, cwd: Path, **env: str):
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        cwd=cwd,
        env=hub_env(hub.url, hf_home, env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def fetched(hub: FakeHub) -> set[str]:
    """The repo paths of the files the hub served (`/REPO/resolve/COMMIT/PATH`)."""
    return {path.split("/resolve/", 1)[1].split("/", 1)[1] for path in hub.file_gets()}


def test_info_fetches_the_config_only_then_training_downloads_once(world, tmp_path):
    files, paths = world
    hf_home = tmp_path / "hf_home"
    with FakeHub(files=files, gated=True) as hub:
        info = lmforge(
            ["model", "info", REPO], hub=hub, hf_home=hf_home, cwd=tmp_path, HF_TOKEN=TOKEN
        )
        assert info.returncode == 0, info.stderr
        assert f"source:      {REPO} (hf)" in info.stdout
        assert fetched(hub) == {"config.json"}

        hub.requests.clear()
        sft = [
            "sft",
            f"run_dir={tmp_path / 'sft'}",
            f"model.source={REPO}",
            f"data.path={paths['sft_train']}",
            "lora.enabled=true",
            "train.steps=2",
            "train.micro_batch_size=2",
            "data.max_seq_len=32",
            "metrics.tensorboard=false",
            "checkpoint.every=0",
        ]
        trained = lmforge(sft, hub=hub, hf_home=hf_home, cwd=tmp_path, HF_TOKEN=TOKEN)
        assert trained.returncode == 0, trained.stderr
        assert fetched(hub) == set(files) - set(UNREAD) - {"config.json"}
        # Every request carried the token; the cache holds the model, not the token.
        assert {auth for _, _, auth in hub.requests} == {f"Bearer {TOKEN}"}
        cache = hf_home / "lmforge" / "models" / REPO
        assert not any((cache / name).exists() for name in UNREAD)
        assert not any(TOKEN.encode() in p.read_bytes() for p in hf_home.rglob("*") if p.is_file())

        # The PEFT adapter names the hub id as its base, so it loads from anywhere.
        adapter = json.loads((tmp_path / "sft/artifact/adapter/adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == REPO

        # From now on the cached copy serves, without a request, even offline.
        hub.requests.clear()
        generate = [
            "generate",
            REPO,
            "--prompt",
            "Ada",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
        ]
        offline = lmforge(generate, hub=hub, hf_home=hf_home, cwd=tmp_path, HF_HUB_OFFLINE="1")
        assert offline.returncode == 0, offline.stderr
        assert hub.requests == []


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_offline_without_a_cached_copy_says_how_to_get_one(world, tmp_path):
    files, _ = world
    with FakeHub(files=files) as hub:
        result = lmforge(
            ["model", "info", REPO], hub=hub, hf_home=tmp_path, cwd=tmp_path, HF_HUB_OFFLINE="1"
        )
        assert hub.requests == []
    line = one_line_error(result)
    for words in (REPO, "HF_HUB_OFFLINE", f"lmforge download {REPO} --out", "local directory"):
        assert words in line


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["quantize", REPO, "OUT", "--scheme", "int8-wo"], ["needs a token", "set HF_TOKEN"]),
        (
            ["model", "info", "nobody/nothing"],
            ["nobody/nothing: no such local directory", "not found"],
        ),
    ],
)
def test_refusals_are_one_line(world, tmp_path, args, words):
    files, _ = world
    with FakeHub(files=files, gated=True, private=True) as hub:
        result = lmforge(args, hub=hub, hf_home=tmp_path, cwd=tmp_path)
        assert hub.file_gets() == []
    line = one_line_error(result)
    for word in words:
        assert word in line


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    from lmforge.hub import is_repo_id

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "local" / "model").mkdir(parents=True)
    assert is_repo_id("meta-llama/Llama-3.2-1B")
    assert not is_repo_id("models/Llama-3.1-70B")  # a download to come into models/
    assert not is_repo_id("local/model")  # exists
    for path in ("runs/tiny/pretrain/artifact", "./a/b", "/abs/a", "../a/b", "tiny", "a/b/"):
        assert not is_repo_id(path), path
