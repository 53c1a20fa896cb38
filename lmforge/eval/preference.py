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

import torch
import torch.nn.functional as F

from lmforge.errors import ModelFormatError
from lmforge.train.losses import IGNORE_INDEX


@torch.inference_mode()
def response_logprobs(
    model: torch.nn.Module,
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    batch_size: int,
    device: torch.device,
    pad_id: int = 0,
) -> list[float]:
    """Sum of log p(label) over labelled positions, for (inputs [n], labels [n]) pairs."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
    out = [0.0] * len(sequences)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        length = max(len(sequences[i][0]) for i in chunk)
        inputs = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), length), IGNORE_INDEX, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids, lab = sequences[i]
            inputs[row, : len(ids)] = torch.as_tensor(ids)
            labels[row, : len(lab)] = torch.as_tensor(lab)
        # Right padding under a causal mask leaves the real positions' logits unchanged.
        logits = model(inputs.to(device)).float()  # [b, s, vocab]
        labels = labels.to(device)
        mask = labels != IGNORE_INDEX
        token_logp = torch.gather(
            F.log_softmax(logits, dim=-1), -1, labels.clamp(min=0).unsqueeze(-1)
        ).squeeze(-1)  # [b, s]
        sums = (token_logp * mask).sum(dim=-1)
        for row, i in enumerate(chunk):
            out[i] = float(sums[row])
    return out


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
        sequences.append(
            (torch.from_numpy(sample.chosen_inputs), torch.from_numpy(sample.chosen_labels))
        )
        sequences.append(
            (torch.from_numpy(sample.rejected_inputs), torch.from_numpy(sample.rejected_labels))
        )
    pad_id = loaded.tokenizer.pad_id if loaded.tokenizer.pad_id is not None else 0
    scores = response_logprobs(
        loaded.model, sequences, batch_size=batch_size, device=device_, pad_id=pad_id
    )
    margins = [scores[2 * i] - scores[2 * i + 1] for i in range(len(data.samples))]
    return {
        "accuracy": sum(m > 0 for m in margins) / len(margins),
        "mean_margin": sum(margins) / len(margins),
        "num_pairs": len(margins),
    }
