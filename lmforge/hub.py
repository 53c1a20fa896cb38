"""Downloading a model repo from the Hugging Face hub into a plain directory.

`huggingface_hub.snapshot_download` does the transfer (into `local_dir`, so the directory is a
model artifact as it is, with its bookkeeping under `<dir>/.cache/huggingface/`); re-running it
skips complete files and continues partial ones. This module adds what a user needs around it:
the file list resolved once against one commit, an early access check so a gated repo fails
before any progress bar, every hub failure turned into one `HubError` line that says what to do,
and a check that every selected file really landed (the library quietly returns an existing
`local_dir` when the hub cannot be reached half-way). The token is only ever handed to
huggingface_hub as an argument: it is sent to the hub and never written anywhere.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import HubError, ModelFormatError, UserError

# Files a gated repo still serves without a token; a useless access probe.
_UNGATED_FILES = {"README.md", ".gitattributes"}


@dataclass(frozen=True)
class DownloadResult:
    """What `download_snapshot` fetched: the repo at one commit, the selected files (repo paths,
    all present under `out_dir` now) and their total size on disk."""

    repo_id: str
    commit: str
    out_dir: Path
    files: tuple[str, ...]
    num_bytes: int


def download(
    repo_id: str,
    out_dir: str | Path,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
) -> Path:
    """Download `repo_id` into `out_dir` and return the directory; see `download_snapshot`."""
    return download_snapshot(
        repo_id,
        out_dir,
        include=include,
        exclude=exclude,
        revision=revision,
        token=token,
        endpoint=endpoint,
    ).out_dir


def download_snapshot(
    repo_id: str,
    out_dir: str | Path,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    revision: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    cache_hint: str | None = None,
) -> DownloadResult:
    """Download the files of model repo `repo_id` into `out_dir`, resuming a previous run.

    Args:
        include: glob patterns (fnmatch, `*` also crosses `/`); only matching files are fetched.
        exclude: glob patterns of files to leave out, applied after `include`.
        revision: branch, tag or commit; the default branch when None.
        token: hub access token, sent as a request header only. None lets huggingface_hub use
            its own default (HF_TOKEN or a token saved by `hf auth login`).
        endpoint: hub URL; None means huggingface_hub's default (HF_ENDPOINT or huggingface.co).
        cache_hint: what the user can do when the hub cannot be reached and `out_dir` is lmforge's
            cache rather than a directory they chose (the error message's second half).

    Returns:
        The commit downloaded, the selected files and their total size.

    Raises:
        HubError: the hub cannot be reached, refuses access, or does not know the repo or
            revision; or the download ended with files missing.
        UserError: `out_dir` is not a directory, or the patterns select no file.
    """
    # Imported here: `lmforge --help` and every other command should not pay for it.
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} exists and is not a directory")
    api = huggingface_hub.HfApi(endpoint=endpoint, token=token)
    where = _Where(
        repo_id=repo_id,
        revision=revision,
        endpoint=api.endpoint,
        out_dir=out_dir,
        cache_hint=cache_hint,
    )
    allow_patterns = list(include) if include else None
    ignore_patterns = list(exclude) if exclude else None

    try:
        # Pin one commit: the file list, the access probe and every file come from it, and a
        # re-run with a commit revision lets huggingface_hub skip complete files without a call.
        info = api.model_info(repo_id, revision=revision, token=token)
        commit = info.sha or revision or "main"  # a mirror may leave the sha out
        repo_files = [sibling.rfilename for sibling in info.siblings or []]
        files = list(
            filter_repo_objects(
                repo_files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns
            )
        )
        if repo_files and not files:
            raise UserError(
                f"no file of {repo_id} matches include={allow_patterns} exclude={ignore_patterns}; "
                f"it has: {_sample(repo_files, 12)}"
            )
        probe = next((name for name in files if name not in _UNGATED_FILES), None)
        if probe is not None:
            url = huggingface_hub.hf_hub_url(repo_id, probe, revision=commit, endpoint=endpoint)
            huggingface_hub.get_hf_file_metadata(url, token=token, endpoint=endpoint)
        huggingface_hub.snapshot_download(
            repo_id,
            revision=commit,
            local_dir=out_dir,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
            token=token,
            endpoint=endpoint,
        )
    except UserError:
        raise
    except Exception as err:
        hub_error = _to_hub_error(err, where=where, token_given=token is not None)
        if hub_error is None:
            raise
        raise hub_error from err

    missing = [name for name in files if not (out_dir / name).is_file()]
    if missing:
        raise HubError(
            f"the download of {repo_id} into {out_dir} is incomplete ({len(missing)} of "
            f"{len(files)} files missing: {_sample(missing, 3)}); run the same command again "
            "to resume"
        )
    num_bytes = sum((out_dir / name).stat().st_size for name in files)
    return DownloadResult(
        repo_id=repo_id, commit=commit, out_dir=out_dir, files=tuple(files), num_bytes=num_bytes
    )


@dataclass(frozen=True)
class _Where:
    """The request a hub error happened in, for the message."""

    repo_id: str
    revision: str | None
    endpoint: str
    out_dir: Path
    cache_hint: str | None = None


def _to_hub_error(err: Exception, *, where: _Where, token_given: bool) -> HubError | None:
    """The one-line `HubError` for a failure from huggingface_hub or its HTTP client, or None
    for anything else (a bug or a local problem such as a full disk keeps its traceback)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, endpoint = where.repo_id, where.endpoint
    if isinstance(err, HFValidationError):
        return HubError(f"{repo!r} is not a valid repo id: expected 'namespace/name'")
    if isinstance(err, RevisionNotFoundError):
        return HubError(f"revision {where.revision!r} not found in {repo} on {endpoint}")
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        page = f"{endpoint}/{repo}"
        if status == 401 and not token_given:
            return HubError(
                f"{repo} on {endpoint} needs a token (gated or private repo, or it does not "
                f"exist): accept its terms on {page}, then "
                + (
                    "set HF_TOKEN"
                    if where.cache_hint is not None
                    else "pass --token or set HF_TOKEN"
                )
            )
        if status == 401:
            return HubError(
                f"the hub at {endpoint} did not accept the token for {repo} (HTTP 401): check "
                "that it is valid and has read access, or that the repo exists"
            )
        if status == 403 or isinstance(err, GatedRepoError):
            return HubError(
                f"access to {repo} has not been granted to this token (HTTP {status}): request "
                f"access on {page} and wait for approval, or use a token allowed to read gated repos"
            )
        if status == 404 or isinstance(err, RepositoryNotFoundError):
            return HubError(f"repo {repo} not found on {endpoint}: check the name (namespace/name)")
        return HubError(f"the hub at {endpoint} answered HTTP {status} for {repo}; try again later")
    # LocalEntryNotFoundError is huggingface_hub's "no answer from the hub, no local copy".
    offline = isinstance(err, OfflineModeIsEnabled)
    if offline or isinstance(err, LocalEntryNotFoundError) or _is_connection_error(err):
        reason = "HF_HUB_OFFLINE is set" if offline else "no connection"
        if where.cache_hint is not None:
            return HubError(
                f"the Hugging Face hub at {endpoint} cannot be reached ({reason}): {where.cache_hint}"
            )
        have_files = where.out_dir.is_dir() and any(where.out_dir.iterdir())
        already = f", or use {where.out_dir} as it is if it is complete" if have_files else ""
        return HubError(
            f"the Hugging Face hub at {endpoint} cannot be reached ({reason}): download {repo} "
            "on a machine that can reach it, copy the directory here and pass that local "
            f"directory instead of the repo id{already}"
        )
    return None


def _is_connection_error(err: BaseException) -> bool:
    """Whether `err` means the hub did not answer: a socket error, or a transport error of the
    HTTP client huggingface_hub uses (httpx2 or httpx in recent versions, requests in older)."""
    if isinstance(err, ConnectionError | TimeoutError):
        return True
    for module_name, class_name in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "ConnectionError"),
        ("requests", "Timeout"),
    ):
        module = sys.modules.get(module_name)  # a client never imported raised nothing
        error_type = getattr(module, class_name, None) if module is not None else None
        if isinstance(error_type, type) and isinstance(err, error_type):
            return True
    return False


def _sample(names: Sequence[str], limit: int) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


# ----------------------------------------------------------------------------- hub ids as models

# A hub id: `namespace/name` of letters, digits, `-`, `_` and `.` (huggingface_hub's rule, less
# its corner cases); anything else, or a path that exists, is a local path.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
# Enough to know a model's shape and format without its weights.
_CONFIG_FILES = ("config.json", "params.json", "original/params.json")
# Weight formats lmforge never reads; a repo often carries them beside safetensors, so leaving
# them out saves their size (for Meta's repos, a second copy of the weights in
# original/consolidated.*.pth, read only when the repo has no config.json).
_UNREAD_WEIGHTS = ["*.bin", "*.pt", "*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack", "*.ot"]
_META_WEIGHTS = ["original/consolidated*", "*.pth"]
_COMPLETE_MARKER = Path(".cache") / "lmforge" / "complete.json"


def is_repo_id(source: str | Path) -> bool:
    """Whether `source` reads as a hub id (`namespace/name`) rather than a local path: it has
    that shape, no such file or directory exists, and neither does a local directory
    `namespace` (then `models/Llama-3.1-70B` is a download still to come, not a repo)."""
    text = str(source)
    if not _REPO_ID.fullmatch(text) or ".." in text:
        return False
    return not Path(text).exists() and not Path(text.split("/")[0]).exists()


def is_cached(repo_id: str, *, weights: bool = True) -> bool:
    """Whether `cached_model(repo_id, weights=...)` would answer without asking the hub."""
    out_dir = model_cache_dir(repo_id)
    if (out_dir / _COMPLETE_MARKER).is_file():
        return True
    return not weights and any((out_dir / name).is_file() for name in _CONFIG_FILES)


def model_cache_dir(repo_id: str) -> Path:
    """Where a hub id given as a model is kept: `$HF_HOME/lmforge/models/NAMESPACE/NAME` (so
    HF_HOME on a shared file system gives every node one copy)."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "lmforge" / "models" / repo_id


def cached_model(repo_id: str, *, weights: bool = True) -> Path:
    """The local copy of hub model `repo_id`, downloaded into `model_cache_dir` on first use.

    With `weights=False` only the config (config.json or params.json) is needed, so shape-only
    commands (`lmforge model info`, `lmforge plan`) do not fetch gigabytes. A complete copy is
    used as it is from then on (no hub request, so it works offline, pinned to the commit first
    downloaded); an incomplete one is resumed. The token is huggingface_hub's (HF_TOKEN, else
    the one `hf auth login` saved), as for `lmforge download`.

    Raises:
        HubError: the hub cannot be reached (one line saying how to get the model here instead),
            refuses access, or does not know the repo.
        ModelFormatError: the repo has no config.json or params.json.
    """
    out_dir = model_cache_dir(repo_id)
    if is_cached(repo_id, weights=weights):
        return out_dir
    import huggingface_hub

    hint = (
        f"{repo_id} is not in lmforge's model cache ({out_dir}) yet: where the hub can be "
        f"reached, run `lmforge download {repo_id} --out DIR`, copy DIR here and give that "
        "local directory as the model instead of the hub id"
    )
    token = huggingface_hub.get_token()
    try:
        config = download_snapshot(
            repo_id, out_dir, include=_CONFIG_FILES, token=token, cache_hint=hint
        )
    except HubError:
        raise
    except UserError:  # no file matched the config names
        raise ModelFormatError(
            f"hub repo {repo_id} has no config.json or params.json: not a model lmforge can read"
        ) from None
    if not weights:
        return out_dir
    exclude = _UNREAD_WEIGHTS + (_META_WEIGHTS if "config.json" in config.files else [])
    print(f"downloading {repo_id} into {out_dir} (first use of this hub id)", file=sys.stderr)
    result = download_snapshot(
        repo_id, out_dir, exclude=exclude, revision=config.commit, token=token, cache_hint=hint
    )
    _write_marker(out_dir, result)
    return out_dir


def _write_marker(out_dir: Path, result: DownloadResult) -> None:
    """Record a complete download (atomically: the marker is what later runs trust)."""
    marker = out_dir / _COMPLETE_MARKER
    marker.parent.mkdir(parents=True, exist_ok=True)
    staging = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    record = {"repo_id": result.repo_id, "commit": result.commit, "files": list(result.files)}
    staging.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, marker)
