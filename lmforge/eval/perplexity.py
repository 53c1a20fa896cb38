"""Token-level perplexity of held-out text, with a sliding window.

Each file is one document: the prefix token (BOS, else EOS), then the file's tokens. Windows of
`seq_len` tokens start every `stride` tokens; each window scores only the tokens no earlier
window scored, so every token after the prefix is predicted exactly once, with at least
`seq_len - stride` tokens of context once the text is longer than one window (stride ==
seq_len: disjoint windows, the cheapest and most pessimistic). Perplexity is exp of the mean
negative log-likelihood over all scored tokens of all files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from lmforge.api import LoadedModel
from lmforge.errors import ConfigError, DataError
from lmforge.eval.harness import LmforgeLM, model_record
from lmforge.generate.logprobs import sequence_logprobs

DEFAULT_MAX_SEQ_LEN = 2048


def sliding_windows(num_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, num_scored) windows over positions 0..num_tokens-1 of one document: the
    model reads tokens[start:end-1] (at most seq_len) and the last `num_scored` of
    tokens[start:end] are scored."""
    windows = []
    scored_until = 1  # position 0 (the prefix token) is never a target
    start = 0
    while scored_until < num_tokens:
        end = min(start + seq_len + 1, num_tokens)
        windows.append((start, end, end - scored_until))
        scored_until = end
        start += stride
    return windows


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{file}: no such file (held-out text for perplexity)") from None
    except UnicodeDecodeError:
        raise DataError(f"{file}: not UTF-8 text") from None
    except OSError as err:
        raise DataError(f"{file}: cannot read: {err.strerror}") from None


def perplexity(
    source: str | Path | LoadedModel | LmforgeLM,
    text_files: Sequence[str | Path],
    *,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str | None = None,
) -> dict:
    """Perplexity of a model on text files.

    Args:
        source: a model source, a `LoadedModel`, or an `LmforgeLM` already built.
        text_files: UTF-8 text files, each one document.
        seq_len: window length in tokens (default: the model's max_seq_len, at most 2048).
        stride: tokens between window starts, 1..seq_len (default: seq_len // 2).

    Returns:
        {"perplexity", "nll_per_token", "num_tokens", "seq_len", "stride", "model",
        "files": [{"file", "num_tokens", "perplexity"}, ...]}.
    """
    lm = (
        source
        if isinstance(source, LmforgeLM)
        else LmforgeLM(source, batch_size=batch_size, device=device, dtype=dtype)
    )
    seq_len = seq_len or min(lm.max_length, DEFAULT_MAX_SEQ_LEN)
    stride = stride or max(1, seq_len // 2)
    if seq_len < 2:
        raise ConfigError(f"seq_len must be >= 2 (a token and its context), got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise ConfigError(f"stride must be between 1 and seq_len ({seq_len}), got {stride}")
    if seq_len > lm.max_length:
        raise ConfigError(f"seq_len {seq_len} exceeds the model's max_length {lm.max_length}")
    if not text_files:
        raise ConfigError("no text files given for perplexity")

    per_file = []
    total_nll, total_tokens = 0.0, 0
    for name in text_files:
        file = Path(name).expanduser()
        tokens = [lm.prefix_token_id, *lm.tokenizer.encode(_read_text(file))]
        if len(tokens) < 2:
            raise DataError(f"{file}: no text to score")
        windows = [
            (tokens[start:end], num_scored)
            for start, end, num_scored in sliding_windows(len(tokens), seq_len, stride)
        ]
        scores = sequence_logprobs(lm.model, windows, batch_size=lm.batch_size, device=lm.device)
        nll = -math.fsum(logprob for logprob, _ in scores)
        count = len(tokens) - 1
        per_file.append(
            {"file": str(file), "num_tokens": count, "perplexity": math.exp(nll / count)}
        )
        total_nll += nll
        total_tokens += count
    return {
        "perplexity": math.exp(total_nll / total_tokens),
        "nll_per_token": total_nll / total_tokens,
        "num_tokens": total_tokens,
        "seq_len": seq_len,
        "stride": stride,
        "model": model_record(lm.loaded.source),
        "files": per_file,
    }
