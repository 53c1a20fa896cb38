"""Pretraining data: prepared token shards (`TokenShards`) and the packed loader over them.

The shards written by `lmforge prepare` are one stream of tokens (documents joined as
`[BOS] ... EOS`). `PackedLoader` cuts that stream into windows of `seq_len + 1` tokens taken with
stride `seq_len`: window w covers tokens `[w * seq_len, w * seq_len + seq_len + 1)`, so the last
token of one window is the first of the next and every token after the first is a target exactly
once. Sample inputs are the window's first `seq_len` tokens, labels its last `seq_len`.

Order: epoch e visits all windows in the permutation drawn by `numpy.random.default_rng([seed,
e])`. Global sample g (counting from the start of training, across epochs) is window
`perm_{g // num_windows}[g % num_windows]`. Each step consumes `micro_batch_size * dp_size`
consecutive global samples; data-parallel rank r takes samples `base + r + k * dp_size` for
k < micro_batch_size, so the ranks' slices are disjoint and together are the global order.

The loader's state is the number of global samples consumed, the same on every rank. Restoring
it reproduces the exact next batch; if `dp_size` (or `micro_batch_size`) changed, the new layout
continues from the same global sample, so no sample is skipped or repeated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import DataError, UserError

STATE_VERSION = 1
_SHARDS_FORMAT = "lmforge-token-shards"


class TokenShards:
    """A directory made by `lmforge prepare`, opened read-only with `np.memmap`.

    Attributes:
        path: the directory.
        meta: meta.json as a dict.
        dtype: the on-disk token dtype (uint16 or uint32).
        vocab_size, eos_id, bos_id: from the tokenizer the shards were made with.
        fingerprint: that tokenizer's fingerprint.
        num_tokens, num_documents: of the whole stream.
        doc_starts: int64 [num_documents], the stream offset where each document starts.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise DataError(
                f"{self.path}: not a prepared token-shard directory (no meta.json); "
                "make one with `lmforge prepare --input ... --tokenizer ... --out DIR`"
            )
        self.meta = _read_json(meta_file)
        index = _read_json(self.path / "index.json")
        if self.meta.get("format") != _SHARDS_FORMAT or index.get("format") != _SHARDS_FORMAT:
            raise DataError(f"{self.path}: meta.json or index.json is not an lmforge token index")
        try:
            self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
            self.vocab_size = int(self.meta["vocab_size"])
            self.eos_id = self.meta["eos_id"]
            self.bos_id = self.meta.get("bos_id")
            self.fingerprint = str(self.meta["tokenizer_fingerprint"])
            shard_entries = index["shards"]
        except (KeyError, TypeError) as err:
            raise DataError(f"{self.path}: meta.json or index.json lacks {err}") from None

        self._tokens: list[np.memmap] = []
        starts: list[np.ndarray] = []
        offset = 0
        for entry in shard_entries:
            file = self.path / entry["file"]
            num_tokens = int(entry["num_tokens"])
            expected = num_tokens * self.dtype.itemsize
            size = file.stat().st_size if file.is_file() else None
            if size != expected:
                found = "is missing" if size is None else f"holds {size} bytes"
                raise DataError(
                    f"{file}: {found}, index.json says {num_tokens} {self.dtype.name} tokens "
                    f"({expected} bytes); the directory is damaged, run `lmforge prepare` again"
                )
            self._tokens.append(np.memmap(file, dtype=self.dtype, mode="r", shape=(num_tokens,)))
            try:
                doc_starts = np.load(self.path / entry["docs"])
            except (OSError, ValueError) as err:
                raise DataError(f"{self.path / entry['docs']}: cannot read: {err}") from None
            starts.append(doc_starts.astype(np.int64) + offset)
            offset += num_tokens
        # _offsets[i] is the stream offset of shard i's first token; the last entry is the end.
        self._offsets = np.array([0, *np.cumsum([t.size for t in self._tokens])], dtype=np.int64)
        self.num_tokens = int(self._offsets[-1])
        self.doc_starts = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
        self.num_documents = int(self.doc_starts.size)
        if self.num_tokens == 0 or self.doc_starts[0] != 0:
            raise DataError(f"{self.path}: holds no tokens, or its first document index is not 0")

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.path)!r}, num_tokens={self.num_tokens}, "
            f"num_documents={self.num_documents}, dtype={self.dtype.name})"
        )

    def check_tokenizer(self, fingerprint: str) -> None:
        """Refuse shards made with another tokenizer than the one with `fingerprint`.

        Raises:
            UserError: naming both fingerprints and this directory.
        """
        if fingerprint != self.fingerprint:
            made_with = self.meta.get("tokenizer") or "an unrecorded path"
            raise UserError(
                f"{self.path} was prepared with another tokenizer ({made_with}, fingerprint "
                f"{self.fingerprint}) than the model's (fingerprint {fingerprint}); run "
                "`lmforge prepare` again with the model's tokenizer"
            )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `[start, stop)` of the whole stream (across shards), as int64."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) is outside [0, {self.num_tokens})")
        out = np.empty(stop - start, dtype=np.int64)
        shard = int(np.searchsorted(self._offsets, start, side="right")) - 1
        filled = 0
        while filled < out.size:
            begin = start + filled - self._offsets[shard]
            take = min(out.size - filled, self._tokens[shard].size - begin)
            out[filled : filled + take] = self._tokens[shard][begin : begin + take]
            filled += take
            shard += 1
        return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object")
    return data


class PackedLoader:
    """Endless iterator of packed pretraining micro-batches for one data-parallel rank.

    Each batch is a dict of tensors:
        inputs [b, seq_len] int64 and labels [b, seq_len] int64 (inputs shifted by one);
        with document_masking also document_ids [b, seq_len] int32 (0, 1, ... per document
        inside each sample; see `build_block_causal_mask`) and positions [b, seq_len] int64
        (RoPE positions restarting at 0 at each document start and at the sample start).
    See the module docstring for the window layout, the order and what the state holds.
    """

    def __init__(
        self,
        shards: TokenShards,
        *,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        document_masking: bool = False,
    ):
        if seq_len < 1 or micro_batch_size < 1 or dp_size < 1:
            raise ValueError(
                f"seq_len ({seq_len}), micro_batch_size ({micro_batch_size}) and dp_size "
                f"({dp_size}) must be >= 1"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.shards = shards
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.document_masking = document_masking
        self.num_windows = (shards.num_tokens - 1) // seq_len
        if self.num_windows == 0:
            raise DataError(
                f"{shards.path}: {shards.num_tokens} tokens are too few for one sample of "
                f"seq_len={seq_len} (needs {seq_len + 1})"
            )
        self.samples_consumed = 0  # global samples, all ranks together
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next sample comes from."""
        return self.samples_consumed // self.num_windows

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        # This rank's global sample indices for the next step: [micro_batch_size].
        samples = (
            self.samples_consumed
            + self.dp_rank
            + np.arange(self.micro_batch_size, dtype=np.int64) * self.dp_size
        )
        windows = [self._window(int(g)) for g in samples]
        tokens = np.stack(
            [
                self.shards.read(w * self.seq_len, w * self.seq_len + self.seq_len + 1)
                for w in windows
            ]
        )  # [b, seq_len + 1]
        batch = {
            "inputs": torch.from_numpy(np.ascontiguousarray(tokens[:, :-1])),
            "labels": torch.from_numpy(np.ascontiguousarray(tokens[:, 1:])),
        }
        if self.document_masking:
            ids, positions = zip(*(self._documents(w * self.seq_len) for w in windows))
            batch["document_ids"] = torch.from_numpy(np.stack(ids))
            batch["positions"] = torch.from_numpy(np.stack(positions))
        self.samples_consumed += self.micro_batch_size * self.dp_size
        return batch

    def _window(self, sample: int) -> int:
        epoch, position = divmod(sample, self.num_windows)
        permutation = self._permutations.get(epoch)
        if permutation is None:
            # Keep the current and the next epoch: one step may straddle the boundary.
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
            rng = np.random.default_rng([self.seed, epoch])
            permutation = self._permutations[epoch] = rng.permutation(self.num_windows)
        return int(permutation[position])

    def _documents(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """Document ids [seq_len] int32 and positions [seq_len] int64 of inputs from `start`."""
        offsets = np.arange(start, start + self.seq_len, dtype=np.int64)
        doc_starts = self.shards.doc_starts
        docs = np.searchsorted(doc_starts, offsets, side="right") - 1  # document of each token
        ids = (docs - docs[0]).astype(np.int32)
        # A document begun before the window counts its positions from the window start.
        positions = offsets - np.maximum(doc_starts[docs], start)
        return ids, positions

    def state_dict(self) -> dict[str, int]:
        """A small dict of ints, equal on every rank; `load_state_dict` continues from it."""
        return {
            "version": STATE_VERSION,
            "samples_consumed": self.samples_consumed,
            "epoch": self.epoch,
            "position": self.samples_consumed % self.num_windows,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_tokens": self.shards.num_tokens,
            "num_windows": self.num_windows,
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the next batch is the one the saved loader would have given.

        A changed dp_size or micro_batch_size continues from the same global sample. A changed
        seed, seq_len or dataset cannot continue the same order and raises `UserError`.
        """
        version = int(state.get("version", -1))
        if version != STATE_VERSION:
            raise UserError(
                f"data-loader state version {version} is not supported (expected {STATE_VERSION})"
            )
        for key, ours in (
            ("seed", self.seed),
            ("seq_len", self.seq_len),
            ("num_tokens", self.shards.num_tokens),
        ):
            saved = int(state[key])
            if saved != ours:
                what = "dataset size" if key == "num_tokens" else key
                raise UserError(
                    f"cannot resume the data order: the checkpoint's data loader had {key}="
                    f"{saved}, this run has {key}={ours} ({what} changed; "
                    f"data {self.shards.path}); keep it, or start a new run directory"
                )
        self.samples_consumed = int(state["samples_consumed"])


def build_block_causal_mask(
    document_ids: torch.Tensor, *, shared: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention mask for packed documents: a token sees earlier tokens of its own document,
    and (`shared`) the earlier positions a whole row shares (GRPO's prompt before its group's
    completions).

    Args:
        document_ids: [b, s] integer document ids (as `PackedLoader` makes them).
        shared: optional bool [b, s], True at the positions every later one of the row sees.

    Returns:
        bool [b, 1, s, s], True = may attend; pass it as the model's `attn_mask`.
    """
    seq_len = document_ids.shape[-1]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [b, s, s]
    if shared is not None:
        same |= shared[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)


__all__ = ["PackedLoader", "TokenShards", "build_block_causal_mask"]
