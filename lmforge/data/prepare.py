"""`prepare`: text, jsonl, parquet files or a Hugging Face dataset → memory-mapped token shards.

Rows are read in the main process in a fixed order (inputs as given; a directory's files sorted),
tokenized in chunks by worker processes, and written back in that same order, so the output does
not depend on the number of workers. Each document becomes `[BOS] tokens EOS` (BOS only when the
tokenizer has one); documents are concatenated into one stream cut into shards of `shard_tokens`
tokens (a document may continue in the next shard). The output directory holds:

    tokens-00000.bin   raw little-endian uint16 (vocab_size <= 65536) or uint32 token ids
    docs-00000.npy     int64 offsets, inside that shard, of the documents that start in it
    index.json         per shard: file, docs, num_tokens, num_documents
    meta.json          dtype, vocab_size, eos_id, bos_id, tokenizer_fingerprint, counts, sources

It is written into a hidden sibling directory and renamed into place at the end, so a crash never
leaves a directory that looks complete. `lmforge.data.pretrain.TokenShards` reads it.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator
from tqdm import tqdm

from lmforge.config import Section
from lmforge.errors import ConfigError, DataError, UserError
from lmforge.procs import die_with_parent, process_alive

logger = logging.getLogger(__name__)

SHARDS_FORMAT = "lmforge-token-shards"
SHARDS_VERSION = 1
META_FILE = "meta.json"
INDEX_FILE = "index.json"

# File suffixes (after an optional .gz) that `format = "auto"` recognizes.
SUFFIX_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
# Documents go to a worker in chunks of about this many characters (or documents).
_CHUNK_CHARS = 1 << 20
_CHUNK_DOCS = 1024
# How many malformed rows are logged one by one before only counting them.
_NUM_BAD_ROWS_LOGGED = 5


class PrepareSection(Section):
    """What `lmforge prepare` reads and where it writes; keys are the CLI flags' names."""

    input: list[str] = Field(default_factory=list)
    """Files, directories (their files with known suffixes, sorted) or glob patterns."""
    tokenizer: str | None = None
    """A tokenizer directory or file (tokenizer.json, tokenizer.model), or a model artifact."""
    out: str | None = None
    """The directory to create; it must not exist yet (or be empty)."""
    format: Literal["auto", "text", "jsonl", "parquet"] = "auto"
    """`auto` picks by suffix: .txt .text .md → text, .jsonl .ndjson → jsonl, .parquet .pq."""
    text_field: str = "text"
    """The jsonl field / parquet or dataset column holding the text."""
    text_split: Literal["file", "paragraph"] = "file"
    """For text files: a whole file is one document, or each blank-line-separated paragraph."""
    workers: int = Field(0, ge=0)
    """Tokenizer processes; 0 means one per available CPU core."""
    shard_tokens: int = Field(100_000_000, ge=1)
    """Tokens per shard file (the last one holds the rest)."""
    skip_bad_rows: bool = False
    """Count and log malformed rows instead of stopping at the first one."""
    max_bad_fraction: float = Field(0.01, ge=0, le=1)
    """With skip_bad_rows: fail when more than this fraction of rows is malformed."""
    dataset: str | None = None
    """A Hugging Face dataset name, read through `datasets` (pip install datasets)."""
    split: str = "train"
    dataset_config: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _one_input_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


@dataclass
class PrepareResult:
    """What `prepare` wrote."""

    out_dir: Path
    dtype: str
    num_documents: int
    num_tokens: int
    num_shards: int
    num_rows: int
    num_bad_rows: int
    num_empty_documents: int


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


# ----------------------------------------------------------------------------------------------
# Sources and rows


@dataclass
class _Source:
    """One input: a file with its format, or a hub dataset (`path` None)."""

    name: str
    format: str
    path: Path | None = None
    num_rows: int = 0
    num_documents: int = 0
    num_bad_rows: int = 0
    num_empty_documents: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.name,
            "format": self.format,
            "num_rows": self.num_rows,
            "num_documents": self.num_documents,
            "num_bad_rows": self.num_bad_rows,
            "num_empty_documents": self.num_empty_documents,
        }


@dataclass(frozen=True)
class _Row:
    """One row: its text, or the reason it is malformed. `where` is `file:line`."""

    where: str
    text: str | None = None
    problem: str | None = None


def _detect_format(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return SUFFIX_FORMATS.get(suffixes[-1]) if suffixes else None


def expand_inputs(
    item: str, *, is_data_file: Callable[[Path], bool], known: str, key: str = "input"
) -> list[Path]:
    """The files an input names: a file, a directory's data files (sorted), or a glob.

    Raises:
        DataError: naming the input (and the config key) when it matches nothing.
    """
    path = Path(item).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and is_data_file(p))
        if not files:
            raise DataError(f"{path}: directory holds no data files (suffixes: {known})")
        return files
    if path.is_file():
        return [path]
    if glob.has_magic(item):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(item), recursive=True))
        files = [p for p in files if p.is_file()]
        if not files:
            raise DataError(f"{item}: no file matches this pattern ({key})")
        return files
    raise DataError(f"{path}: no such file or directory ({key})")


def _resolve_inputs(inputs: list[str], fmt: str) -> list[_Source]:
    """Expand directories and globs into files, each with its format; errors name the input."""
    sources: list[_Source] = []
    known = " ".join(sorted(SUFFIX_FORMATS))
    for item in inputs:
        files = expand_inputs(
            item, is_data_file=lambda p: _detect_format(p) is not None, known=known
        )
        for file in files:
            file_format = fmt if fmt != "auto" else _detect_format(file)
            if file_format is None:
                raise DataError(
                    f"{file}: cannot tell the format from the suffix; pass --format "
                    "text, jsonl or parquet (or rename it to .txt, .jsonl, .parquet)"
                )
            sources.append(_Source(name=str(file), format=file_format, path=file))
    return sources


def _open_binary(path: Path) -> io.BufferedIOBase:
    try:
        return gzip.open(path, "rb") if path.suffix.lower() == ".gz" else path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror}") from None


def _read_lines(path: Path) -> Iterator[bytes]:
    try:
        with _open_binary(path) as handle:
            yield from handle
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"{path}: cannot read: {getattr(err, 'strerror', None) or err}") from None


def _text_rows(path: Path, split: str) -> Iterator[_Row]:
    """A whole file as one document, or one document per blank-line-separated paragraph."""
    if split == "file":
        data = b"".join(_read_lines(path))
        try:
            yield _Row(f"{path}:1", text=data.decode("utf-8"))
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            yield _Row(f"{path}:{line}", problem=f"not UTF-8 text (byte {err.start})")
        return
    lines: list[str] = []
    start = 0
    problem: tuple[int, str] | None = None
    for number, raw in enumerate(_read_lines(path), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            problem = problem or (number, f"not UTF-8 text (byte {err.start} of the line)")
            line = "x"  # keeps the paragraph open
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
            continue
        if lines:
            yield _paragraph(path, start, lines, problem)
            lines, problem = [], None
    if lines:
        yield _paragraph(path, start, lines, problem)


def _paragraph(path: Path, start: int, lines: list[str], problem: tuple[int, str] | None) -> _Row:
    if problem is not None:
        return _Row(f"{path}:{problem[0]}", problem=problem[1])
    return _Row(f"{path}:{start}", text="".join(lines).rstrip("\r\n"))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _field_text(record: Any, text_field: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, problem) for one decoded record."""
    if not isinstance(record, dict):
        return None, f"expected a JSON object with a {text_field!r} field, got {_json_type(record)}"
    if text_field not in record:
        keys = ", ".join(map(str, list(record)[:10])) or "none"
        return None, f"missing field {text_field!r} (fields: {keys})"
    value = record[text_field]
    if not isinstance(value, str):
        return None, f"field {text_field!r} is {_json_type(value)}, expected a string"
    return value, None


def _jsonl_rows(path: Path, text_field: str) -> Iterator[_Row]:
    for number, raw in enumerate(_read_lines(path), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            yield _Row(where, problem=f"not UTF-8 text (byte {err.start} of the line)")
            continue
        except json.JSONDecodeError as err:
            yield _Row(where, problem=f"invalid JSON: {err.msg} (column {err.colno})")
            continue
        text, problem = _field_text(record, text_field)
        yield _Row(where, text=text, problem=problem)


def _import_pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UserError(
            "reading parquet files needs pyarrow: pip install pyarrow "
            "(or pip install 'lmforge[data]')"
        ) from None
    return pyarrow, pyarrow.parquet


def _parquet_rows(path: Path, text_field: str) -> Iterator[_Row]:
    """Rows of a parquet file; `where` is `file:ROW` (1-based row number)."""
    pa, pq = _import_pyarrow()
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: not a readable parquet file: {err}") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        raise DataError(
            f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
            "choose one with --text-field"
        )
    column_type = schema.field(text_field).type
    is_text = pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
    if not (is_text or getattr(pa.types, "is_string_view", lambda _: False)(column_type)):
        raise DataError(f"{path}: column {text_field!r} has type {column_type}, expected strings")
    number = 0
    try:
        for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                number += 1
                if value is None:
                    yield _Row(f"{path}:{number}", problem=f"field {text_field!r} is null")
                else:
                    yield _Row(f"{path}:{number}", text=value)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: cannot read row {number + 1}: {err}") from None


_UNREACHABLE_HINTS = ("offline", "connect", "resolve", "reach", "network", "timed out", "timeout")


def _looks_unreachable(err: BaseException) -> bool:
    """Whether an exception (or one it came from) says the hub could not be reached."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConnectionError | TimeoutError):
            return True
        text = f"{type(current).__name__} {current}".lower()
        if any(hint in text for hint in _UNREACHABLE_HINTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _dataset_rows(source: _Source, cfg: PrepareSection) -> Iterator[_Row]:
    """Rows of a Hugging Face dataset split; `where` is `name[split]:ROW`."""
    name = cfg.dataset
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"--dataset {name} needs the datasets package: pip install datasets "
            "(or pip install 'lmforge[data]'); or pass local files with --input"
        ) from None
    described = name + (f" (config {cfg.dataset_config})" if cfg.dataset_config else "")
    try:
        dataset = datasets.load_dataset(name, cfg.dataset_config, split=cfg.split)
    except Exception as err:  # datasets raises many unrelated types for the same problems
        if _looks_unreachable(err):
            raise DataError(
                f"cannot reach the Hugging Face hub to load dataset {described}, split "
                f"{cfg.split!r} ({_first_line(err)}); pass local files with --input instead, or "
                "load it once where the hub is reachable (it is cached for offline use)"
            ) from None
        raise DataError(
            f"cannot load dataset {described}, split {cfg.split!r}: {_first_line(err)}"
        ) from None
    columns = list(getattr(dataset, "column_names", None) or [])
    if columns and cfg.text_field not in columns:
        raise DataError(
            f"dataset {described}: no column {cfg.text_field!r} (columns: {', '.join(columns)}); "
            "choose one with --text-field"
        )
    for number, record in enumerate(dataset, start=1):
        text, problem = _field_text(record, cfg.text_field)
        yield _Row(f"{source.name}:{number}", text=text, problem=problem)


def _rows(source: _Source, cfg: PrepareSection) -> Iterator[_Row]:
    if source.path is None:
        return _dataset_rows(source, cfg)
    if source.format == "text":
        return _text_rows(source.path, cfg.text_split)
    if source.format == "jsonl":
        return _jsonl_rows(source.path, cfg.text_field)
    return _parquet_rows(source.path, cfg.text_field)


@dataclass
class BadRows:
    """Malformed rows: raise at the first (default), or count them, log the first few and
    refuse more than `max_fraction` of all rows (`check`). `option` and `fraction_option` name
    the settings in messages (a command-line flag or a config key)."""

    skip: bool
    max_fraction: float
    option: str = "skip_bad_rows=true"
    fraction_option: str = "max_bad_fraction"
    count: int = 0
    first: str | None = None

    def add(self, where: str, problem: str) -> None:
        message = f"{where}: {problem}"
        if not self.skip:
            raise DataError(f"{message} ({self.option} skips malformed rows)")
        self.count += 1
        self.first = self.first or message
        if self.count <= _NUM_BAD_ROWS_LOGGED:
            logger.warning("skipping malformed row %s", message)
        elif self.count == _NUM_BAD_ROWS_LOGGED + 1:
            logger.warning("more malformed rows; only counting them from now on")

    def check(self, num_rows: int, what: str = "rows") -> None:
        """Raise when more than `max_fraction` of `num_rows` rows were malformed."""
        if self.count and self.count > self.max_fraction * num_rows:
            raise DataError(
                f"{self.count} of {num_rows} {what} are malformed ({self.count / num_rows:.2%}), "
                f"more than {self.fraction_option}={self.max_fraction} allows; the first: "
                f"{self.first}"
            )


def _documents(sources: list[_Source], cfg: PrepareSection, bad: BadRows) -> Iterator[list[str]]:
    """Non-empty document texts in input order, in chunks; counts rows into the sources."""
    chunk: list[str] = []
    num_chars = 0
    for source in sources:
        for row in _rows(source, cfg):
            source.num_rows += 1
            if row.problem is not None:
                source.num_bad_rows += 1
                bad.add(row.where, row.problem)
                continue
            if not row.text:
                source.num_empty_documents += 1
                continue
            source.num_documents += 1
            chunk.append(row.text)
            num_chars += len(row.text)
            if num_chars >= _CHUNK_CHARS or len(chunk) >= _CHUNK_DOCS:
                yield chunk
                chunk, num_chars = [], 0
    if chunk:
        yield chunk


# ----------------------------------------------------------------------------------------------
# Tokenizing (in worker processes)

_worker_tokenizer = None


def _init_worker(tokenizer_path: str, parent_pid: int) -> None:
    from lmforge.data.tokenizer import load_tokenizer

    global _worker_tokenizer
    die_with_parent(signal.SIGKILL, parent=parent_pid)  # a killed prepare leaves no worker
    # One process per core already; the Rust thread pool inside each would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(_worker_tokenizer, texts)


def encode_documents(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize documents as they are stored: `[BOS] ids EOS` each (BOS if the tokenizer has one).

    Returns:
        (all documents' ids concatenated as uint32, each document's length as int64).
    """
    ids = tokenizer.encode_batch(texts, bos=tokenizer.bos_id is not None, eos=True)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(
        itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum())
    )
    return flat, lengths


def _encoded_chunks(
    chunks: Iterable[list[str]], tokenizer, tokenizer_path: str, num_workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded chunks in input order; with several workers, at most 2 per worker in flight."""
    if num_workers <= 1:
        for chunk in chunks:
            yield encode_documents(tokenizer, chunk)
        return
    # spawn: a fresh interpreter, safe whatever threads (torch, tokenizers) the parent runs;
    # as with any spawned pool, a script calling this needs an `if __name__ == "__main__":`.
    # The executor, unlike multiprocessing.Pool, fails when a worker dies instead of hanging.
    executor = ProcessPoolExecutor(
        num_workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer_path, os.getpid()),
    )
    pending: deque[Future] = deque()
    try:
        for chunk in chunks:
            pending.append(executor.submit(_encode_in_worker, chunk))
            if len(pending) >= 2 * num_workers:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        for future in pending:
            future.cancel()
        executor.shutdown(wait=True, cancel_futures=True)


def _result(future: Future) -> tuple[np.ndarray, np.ndarray]:
    try:
        return future.result()
    except BrokenProcessPool:
        raise RuntimeError(
            "a tokenizer worker process died (out of memory?); try fewer --workers"
        ) from None


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------
# Writing shards


@dataclass
class _ShardWriter:
    """Appends documents to the token stream, cutting it into shards of `shard_tokens`."""

    directory: Path
    dtype: np.dtype
    shard_tokens: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    num_tokens: int = 0
    _handle: Any = None
    _shard_start: int = 0  # global offset of the open shard's first token
    _shard_size: int = 0
    _pending_starts: list[np.ndarray] = field(default_factory=list)  # global doc starts

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        starts = self.num_tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        self._pending_starts.append(starts.astype(np.int64))
        tokens = flat.astype(self.dtype, copy=False)
        while tokens.size:
            if self._handle is None:
                name = f"tokens-{len(self.shards):05d}.bin"
                self._handle = (self.directory / name).open("wb")
            take = min(self.shard_tokens - self._shard_size, tokens.size)
            self._handle.write(tokens[:take].tobytes())
            tokens = tokens[take:]
            self._shard_size += take
            self.num_tokens += take
            if self._shard_size == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._handle.close()
        self._handle = None
        index = len(self.shards)
        end = self._shard_start + self._shard_size
        starts = np.concatenate(self._pending_starts) if self._pending_starts else np.zeros(0)
        starts = starts.astype(np.int64)
        inside = starts < end
        np.save(self.directory / f"docs-{index:05d}.npy", starts[inside] - self._shard_start)
        self._pending_starts = [starts[~inside]]
        self.shards.append(
            {
                "file": f"tokens-{index:05d}.bin",
                "docs": f"docs-{index:05d}.npy",
                "num_tokens": self._shard_size,
                "num_documents": int(inside.sum()),
            }
        )
        self._shard_start, self._shard_size = end, 0

    def finish(self) -> None:
        if self._handle is not None:
            self._close_shard()

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# The stage


def _check_config(cfg: PrepareSection) -> None:
    missing = []
    if not cfg.input and not cfg.dataset:
        missing.append("input files (--input PATH ..., key 'input') or a dataset (--dataset NAME)")
    if not cfg.tokenizer:
        missing.append("a tokenizer (--tokenizer DIR, key 'tokenizer')")
    if not cfg.out:
        missing.append("an output directory (--out DIR, key 'out')")
    if missing:
        raise ConfigError("prepare needs " + "; ".join(missing))


def _recipe(cfg: PrepareSection, sources: list[_Source], tokenizer) -> dict[str, Any]:
    """What the shards are made from: a rerun with the same recipe has nothing to do."""
    inputs = []
    for source in sources:
        stamp = {"name": source.name, "format": source.format}
        if source.path is not None:
            stat = source.path.stat()
            stamp.update(bytes=stat.st_size, mtime_ns=stat.st_mtime_ns)
        inputs.append(stamp)
    return {
        "inputs": inputs,
        "tokenizer_fingerprint": tokenizer.fingerprint(),
        "text_field": cfg.text_field,
        "text_split": cfg.text_split,
        "shard_tokens": cfg.shard_tokens,
    }


def _already_prepared(out: Path, recipe: dict[str, Any]) -> PrepareResult | None:
    """The result of an earlier, finished run with the same recipe, or None."""
    try:
        meta = json.loads((out / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("recipe") != recipe:
        return None
    logger.warning("%s: already prepared from the same inputs and tokenizer; nothing to do", out)
    return PrepareResult(
        out_dir=out,
        dtype=meta["dtype"],
        num_documents=meta["num_documents"],
        num_tokens=meta["num_tokens"],
        num_shards=meta["num_shards"],
        num_rows=meta["num_rows"],
        num_bad_rows=meta["num_bad_rows"],
        num_empty_documents=meta["num_empty_documents"],
    )


def _remove_abandoned(out: Path) -> None:
    """Partial outputs of prepare runs that were killed (their process is gone)."""
    for partial in out.parent.glob(f".{out.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            logger.warning("removing %s, left by a prepare run that was killed", partial)
            shutil.rmtree(partial, ignore_errors=True)


def _claim_out_dir(out: Path) -> Path:
    """Check `out` can be created; returns the hidden sibling directory to write into."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(
            f"{out}: already exists and is not an empty directory; choose another --out "
            "or delete it"
        )
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(out)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
    except OSError as err:
        raise UserError(f"cannot write to {out.parent}: {err.strerror or err}") from None
    return partial


def prepare(cfg: PrepareSection, *, progress: bool = True) -> PrepareResult:
    """Tokenize the inputs of `cfg` into token shards in `cfg.out` (see the module docstring).

    Args:
        cfg: the prepare section (inputs, tokenizer, out, ...).
        progress: show a progress bar on stderr (when it is a terminal).

    Raises:
        DataError: a missing or unreadable input, a malformed row (`file:line: reason`), too many
            malformed rows with skip_bad_rows, or no documents at all.
        ConfigError / UserError: a missing setting, an existing output directory, a missing
            optional package.
    """
    from lmforge.data.tokenizer import load_tokenizer

    _check_config(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.eos_id is None:
        raise ConfigError(
            f"tokenizer {cfg.tokenizer} has no EOS token; packed pretraining data needs one "
            "to separate documents"
        )
    dtype = token_dtype(tokenizer.vocab_size)
    sources = _resolve_inputs(cfg.input, cfg.format)
    if cfg.dataset:
        name = f"{cfg.dataset}[{cfg.split}]"
        if cfg.dataset_config:
            name = f"{cfg.dataset}/{cfg.dataset_config}[{cfg.split}]"
        sources.append(_Source(name=name, format="dataset"))
    num_workers = cfg.workers or _available_cores()
    out = Path(cfg.out).expanduser()
    recipe = _recipe(cfg, sources, tokenizer)
    done = _already_prepared(out, recipe)
    if done is not None:
        return done
    partial = _claim_out_dir(out)

    bad = BadRows(cfg.skip_bad_rows, cfg.max_bad_fraction, option="--skip-bad-rows")
    writer = _ShardWriter(partial, dtype, cfg.shard_tokens)
    committed = False
    bar = tqdm(
        desc="tokenizing",
        unit="doc",
        file=sys.stderr,
        disable=None if progress else True,  # None: only on a terminal
        dynamic_ncols=True,
    )
    try:
        chunks = _documents(sources, cfg, bad)
        for flat, lengths in _encoded_chunks(chunks, tokenizer, cfg.tokenizer, num_workers):
            writer.add(flat, lengths)
            bar.update(lengths.size)
            bar.set_postfix(tokens=f"{writer.num_tokens:,}", refresh=False)
        writer.finish()
        bar.close()

        num_rows = sum(s.num_rows for s in sources)
        num_documents = sum(s.num_documents for s in sources)
        num_empty = sum(s.num_empty_documents for s in sources)
        names = ", ".join(s.name for s in sources[:3]) + (" ..." if len(sources) > 3 else "")
        bad.check(num_rows, f"rows in {names}")
        if num_documents == 0:
            raise DataError(
                f"no documents in {names}: {num_rows} rows, {num_empty} empty, "
                f"{bad.count} malformed"
            )
        if bad.count:
            logger.warning(
                "skipped %d malformed rows of %d (first: %s)", bad.count, num_rows, bad.first
            )
        _write_json(
            partial / INDEX_FILE,
            {
                "format": SHARDS_FORMAT,
                "version": SHARDS_VERSION,
                "dtype": dtype.name,
                "shards": writer.shards,
            },
        )
        _write_json(
            partial / META_FILE,
            {
                "format": SHARDS_FORMAT,
                "version": SHARDS_VERSION,
                "dtype": dtype.name,
                "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id,
                "bos_id": tokenizer.bos_id,
                "bos_per_document": tokenizer.bos_id is not None,
                "tokenizer_fingerprint": tokenizer.fingerprint(),
                "tokenizer": str(cfg.tokenizer),
                "num_documents": num_documents,
                "num_tokens": writer.num_tokens,
                "num_shards": len(writer.shards),
                "num_rows": num_rows,
                "num_bad_rows": bad.count,
                "num_empty_documents": num_empty,
                "text_field": cfg.text_field,
                "text_split": cfg.text_split,
                "sources": [s.summary() for s in sources],
                "recipe": recipe,
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
            },
        )
        if out.exists():
            out.rmdir()  # empty, checked by _claim_out_dir
        partial.rename(out)
        committed = True
    finally:
        bar.close()
        if not committed:
            writer.abort()
            with contextlib.suppress(OSError):
                shutil.rmtree(partial)
    return PrepareResult(
        out_dir=out,
        dtype=dtype.name,
        num_documents=num_documents,
        num_tokens=writer.num_tokens,
        num_shards=len(writer.shards),
        num_rows=num_rows,
        num_bad_rows=bad.count,
        num_empty_documents=num_empty,
    )


__all__ = ["PrepareResult", "PrepareSection", "encode_documents", "prepare", "token_dtype"]
