"""A fake Hugging Face hub for tests: a real HTTP server on 127.0.0.1 answering the endpoints
huggingface_hub's `snapshot_download` calls for a model repo (checked against huggingface_hub
2.x: `GET /api/models/{repo}[/revision/{rev}]`, `GET /api/models/{repo}/tree/{rev}`, then
`HEAD` + `GET /{repo}/resolve/{rev}/{path}`, without xet headers so files come over plain HTTP).

huggingface_hub reads HF_ENDPOINT at import, so the code under test runs in a subprocess whose
environment `hub_env` builds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_testtoken_5bd1c2e9a7f04d3b"
REPO = "meta-llama/Tiny-Llama-3"
REPO_FILES = {
    "config.json": b'{"model_type": "llama"}',
    "generation_config.json": b'{"bos_token_id": 1}',
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "model-00001-of-00002.safetensors": bytes(range(256)) * 40,
    "model-00002-of-00002.safetensors": b"\x01" * 7000,
    "tokenizer.json": b'{"version": "1.0"}',
    "README.md": b"# Tiny Llama 3\n",
    "original/consolidated.00.pth": b"\x02" * 9000,
    "original/consolidated.01.pth": b"\x03" * 9000,
    "original/params.json": b'{"dim": 64}',
    "original/tokenizer.model": b"tokenizer-model-bytes",
}


class FakeHub:
    """A model-repo hub on a random local port that records every request it gets.

    `gated`: files need `Authorization: Bearer TOKEN` (401 without a token, 403 with another),
    as gated repos on the hub; `private`: the repo API answers 401 without the token too.
    """

    def __init__(
        self,
        *,
        gated: bool = False,
        private: bool = False,
        repo: str = REPO,
        files: dict[str, bytes] | None = None,
    ) -> None:
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, head=False)

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def log_message(self, *args: object) -> None:
                pass

        self.gated = gated
        self.private = private
        self.repo = repo
        self.files = REPO_FILES if files is None else files
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file_gets(self) -> list[str]:
        return [
            path for method, path, _ in self.requests if method == "GET" and "/resolve/" in path
        ]

    def _answer(self, request: BaseHTTPRequestHandler, *, head: bool) -> None:
        auth = request.headers.get("Authorization")
        path = unquote(urlsplit(request.path).path)
        self.requests.append(("HEAD" if head else "GET", path, auth))
        authorized = auth == f"Bearer {TOKEN}"
        if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path):
            repo, kind, revision = match.groups()
            revision = revision or "main"
            if error := self._repo_error(repo, revision):
                return _send(request, *error, head=head)
            if self.private and not authorized:
                return _send(request, 401, {"X-Error-Code": "RepoNotFound"}, head=head)
            if kind != "tree":
                body = {
                    "id": repo,
                    "sha": COMMIT,
                    "siblings": [{"rfilename": p} for p in self.files],
                }
            else:
                body = [
                    {"type": "file", "path": p, "size": len(data), "oid": _git_oid(data)}
                    for p, data in self.files.items()
                ]
            return _send(
                request,
                200,
                {"Content-Type": "application/json"},
                json.dumps(body).encode(),
                head=head,
            )
        if match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            repo, revision, name = match.groups()
            if error := self._repo_error(repo, revision):
                return _send(request, *error, head=head)
            if (self.gated or self.private) and not authorized:
                status = 403 if auth else 401
                return _send(request, status, {"X-Error-Code": "GatedRepo"}, head=head)
            if name not in self.files:
                return _send(request, 404, {"X-Error-Code": "EntryNotFound"}, head=head)
            data = self.files[name]
            headers = {
                "X-Repo-Commit": COMMIT,
                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                "Content-Type": "application/octet-stream",
            }
            return _send(request, 200, headers, data, head=head)
        return _send(request, 404, {}, head=head)

    def _repo_error(self, repo: str, revision: str) -> tuple[int, dict[str, str]] | None:
        if repo != self.repo:
            return 404, {"X-Error-Code": "RepoNotFound"}
        if revision not in ("main", COMMIT):
            return 404, {"X-Error-Code": "RevisionNotFound"}
        return None


def _send(
    request: BaseHTTPRequestHandler,
    status: int,
    headers: dict[str, str],
    body: bytes = b"",
    *,
    head: bool,
) -> None:
    request.send_response(status)
    for key, value in headers.items():
        request.send_header(key, value)
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    if not head:
        request.wfile.write(body)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_env(endpoint: str, hf_home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without HF_* settings and proxies, pointed at `endpoint`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("HF_") and "proxy" not in key.lower()
    }
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost",
        PYTHONPATH=str(REPO_ROOT),
    )
    env.update(extra or {})
    return env
