"""`lmforge download` against a fake hub (tests/fake_hub.py).

The CLI runs in a subprocess with HF_ENDPOINT pointing at the server (huggingface_hub reads it at
import) and HF_HOME in tmp. The subprocess registers only the `download` command on the real
`lmforge.cli.main`, so the test does not depend on the other command modules.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_hub import COMMIT, REPO, REPO_FILES, REPO_ROOT, TOKEN, FakeHub, hub_env

# Run the real CLI entry point with only this command registered.
CLI = (
    "import sys, lmforge.cli as cli; import lmforge.commands.download as d; cli.COMMAND_MODULES = [d]; "
    "sys.exit(cli.main(['download', *sys.argv[1:]]))"
)


def run_download(
    args: list[str], *, endpoint: str, hf_home: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        cwd=REPO_ROOT,
        env=hub_env(endpoint, hf_home, env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def downloaded_files(out: Path) -> dict[str, bytes]:
    return {
        path.relative_to(out).as_posix(): path.read_bytes()
        for path in out.rglob("*")
        if path.is_file() and ".cache" not in path.relative_to(out).parts
    }


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for word in words:
        assert word in lines[0]
    return lines[0]


def test_exclude_token_and_resume(tmp_path: Path) -> None:
    out, hf_home = tmp_path / "llama3", tmp_path / "hf_home"
    args = [REPO, "--out", str(out), "--exclude", "original/consolidated*"]
    expected = {p: d for p, d in REPO_FILES.items() if not p.startswith("original/consolidated")}
    with FakeHub(gated=True) as hub:
        first = run_download(args, endpoint=hub.url, hf_home=hf_home, env={"HF_TOKEN": TOKEN})
        assert first.returncode == 0, first.stderr
        assert downloaded_files(out) == expected
        assert sorted(hub.file_gets()) == sorted(f"/{REPO}/resolve/{COMMIT}/{p}" for p in expected)
        # Every request carried the token from HF_TOKEN.
        assert {auth for _, _, auth in hub.requests} == {f"Bearer {TOKEN}"}
        summary = first.stdout.strip().splitlines()[-1]
        num_bytes = sum(len(data) for data in expected.values())
        assert f"{len(expected)} files" in summary
        assert f"{num_bytes:,} bytes" in summary
        assert str(out) in summary

        # Re-running fetches no file.
        hub.requests.clear()
        again = run_download(args, endpoint=hub.url, hf_home=hf_home, env={"HF_TOKEN": TOKEN})
        assert again.returncode == 0, again.stderr
        assert hub.file_gets() == []
        assert f"{len(expected)} files" in again.stdout

        # A file lost since is the only one fetched again.
        (out / "model-00002-of-00002.safetensors").unlink()
        hub.requests.clear()
        third = run_download(args, endpoint=hub.url, hf_home=hf_home, env={"HF_TOKEN": TOKEN})
        assert third.returncode == 0, third.stderr
        assert hub.file_gets() == [f"/{REPO}/resolve/{COMMIT}/model-00002-of-00002.safetensors"]
        assert downloaded_files(out) == expected

    for result in (first, again, third):
        assert TOKEN not in result.stdout + result.stderr
    for root in (out, hf_home):
        for path in root.rglob("*"):
            assert not path.is_file() or TOKEN.encode() not in path.read_bytes(), path


def test_include_revision_and_token_flag(tmp_path: Path) -> None:
    out = tmp_path / "tok"
    args = [REPO, "--out", str(out), "--include", "original/*", "--include", "config.json"]
    args += ["--exclude", "*.pth", "--revision", COMMIT, "--token", TOKEN]
    with FakeHub(private=True) as hub:
        result = run_download(args, endpoint=hub.url, hf_home=tmp_path / "hf_home")
    assert result.returncode == 0, result.stderr
    assert set(downloaded_files(out)) == {
        "config.json",
        "original/params.json",
        "original/tokenizer.model",
    }
    assert TOKEN not in result.stdout + result.stderr
    assert all(f"/{COMMIT}" in path for _, path, _ in hub.requests)


@pytest.mark.parametrize(
    ("hub_kind", "token", "words"),
    [
        ("private", None, ["needs a token", "HF_TOKEN"]),  # 401 from the repo API
        ("gated", None, ["needs a token", "HF_TOKEN"]),  # 401 from the file itself
        ("gated", "hf_not_granted_0000", ["not been granted", "403"]),
    ],
)
def test_refused_access_is_one_line(
    tmp_path: Path, hub_kind: str, token: str | None, words: list[str]
) -> None:
    env = {"HF_TOKEN": token} if token else {}
    with FakeHub(**{hub_kind: True}) as hub:
        result = run_download(
            [REPO, "--out", str(tmp_path / "out")], endpoint=hub.url, hf_home=tmp_path, env=env
        )
        assert hub.file_gets() == []
    line = assert_one_line_error(result, REPO, *words)
    assert token is None or token not in line + result.stdout


def test_unknown_repo_and_revision(tmp_path: Path) -> None:
    with FakeHub() as hub:
        missing = run_download(
            ["nobody/no-such-model", "--out", str(tmp_path / "a")],
            endpoint=hub.url,
            hf_home=tmp_path,
        )
        bad_rev = run_download(
            [REPO, "--out", str(tmp_path / "b"), "--revision", "v9"],
            endpoint=hub.url,
            hf_home=tmp_path,
        )
    assert_one_line_error(missing, "nobody/no-such-model", "not found")
    assert_one_line_error(bad_rev, "'v9'", "not found")


def test_unreachable_hub_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    result = run_download(
        [REPO, "--out", str(tmp_path / "out")], endpoint=endpoint, hf_home=tmp_path
    )
    assert_one_line_error(result, endpoint, "cannot be reached", "local directory")
    assert not (tmp_path / "out").exists()


def test_offline_mode_makes_no_request(tmp_path: Path) -> None:
    with FakeHub() as hub:
        result = run_download(
            [REPO, "--out", str(tmp_path / "out")],
            endpoint=hub.url,
            hf_home=tmp_path,
            env={"HF_HUB_OFFLINE": "1"},
        )
        assert hub.requests == []
    assert_one_line_error(result, hub.url, "cannot be reached", "HF_HUB_OFFLINE")


def test_patterns_matching_nothing(tmp_path: Path) -> None:
    with FakeHub() as hub:
        result = run_download(
            [REPO, "--out", str(tmp_path / "out"), "--include", "*.gguf"],
            endpoint=hub.url,
            hf_home=tmp_path,
        )
        assert hub.file_gets() == []
    assert_one_line_error(result, "*.gguf", "config.json")


def test_help_shows_the_seed_example() -> None:
    import argparse

    from lmforge.commands import download

    subparsers = argparse.ArgumentParser(prog="lmforge").add_subparsers()
    download.register(subparsers)
    help_text = subparsers.choices["download"].format_help()
    assert (
        "lmforge download meta-llama/Meta-Llama-3-70B --out models/llama3-70b "
        "--exclude 'original/consolidated*'"
    ) in help_text
