"""Preference accuracy: how often a model prefers the chosen response of a held-out pair.

For each (prompt, chosen, rejected) row, rendered exactly as DPO training renders it (the chat
template, labels on the response tokens only; `lmforge.data.preference`), the model's summed
log-probability of each response given the prompt is computed; the pair counts as preferred when
log p(chosen | prompt) - log p(rejected | prompt) > 0. This is the DPO reward accuracy
(Rafailov et al., 2023, https://arxiv.org/abs/2305.18290) measured without a reference model,
i.e. the model's own log-probability ratio.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.data.sft import IGNORE_INDEX
from lmforge.errors import ModelFormatError
from lmforge.generate.logprobs import sequence_logprobs


def response_tokens(inputs, labels) -> tuple[list[int], int]:
    """(the whole token sequence, the number of response tokens at its end) of a DPO row's
    shifted inputs / labels, for `sequence_logprobs`: the labelled positions are the response,
    which ends the sequence."""
    inputs, labels = list(map(int, inputs)), list(map(int, labels))
    scored = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    n = len(scored)
    assert scored == list(range(len(labels) - n, len(labels))), "the response must end the row"
    return inputs + labels[-1:], n


def preference_accuracy(
    source: str | Path,
    data_file: str | Path,
    *,
    device: str = "auto",
    dtype: str | None = None,
    batch_size: int = 16,
    max_seq_len: int = 2048,
) -> dict:
    """Share of pairs in `data_file` whose chosen response the model `source` prefers.

    Args:
        source: any `lmforge.load` source (artifact, quantized artifact, HF directory).
        data_file: preference rows ({"prompt", "chosen", "rejected"} or the other layouts
            `lmforge.data.preference` reads), e.g. the demo's dpo_heldout.jsonl.

    Returns:
        {"accuracy", "mean_margin" (mean log-prob difference, nats), "num_pairs"}.
    """
    from lmforge.api import load
    from lmforge.data.preference import PreferenceDataSection, load_preference_data
    from lmforge.eval.harness import resolve_device

    device_ = resolve_device(device)
    loaded = load(source, device=device_, dtype=dtype)
    if loaded.tokenizer is None:
        raise ModelFormatError(f"{source}: has no tokenizer; preference accuracy needs one")
    loaded.model.eval()
    cfg = PreferenceDataSection(path=[str(data_file)], max_seq_len=max_seq_len)
    data = load_preference_data(cfg, loaded.tokenizer)
    sequences = []
    for sample in data.samples:
        sequences.append(response_tokens(sample.chosen_inputs, sample.chosen_labels))
        sequences.append(response_tokens(sample.rejected_inputs, sample.rejected_labels))
    scores = [
        logprob
        for logprob, _ in sequence_logprobs(
            loaded.model, sequences, batch_size=batch_size, device=device_
        )
    ]
    margins = [scores[2 * i] - scores[2 * i + 1] for i in range(len(data.samples))]
    return {
        "accuracy": sum(m > 0 for m in margins) / len(margins),
        "mean_margin": sum(margins) / len(margins),
        "num_pairs": len(margins),
    }
