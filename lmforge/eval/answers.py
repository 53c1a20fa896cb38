"""Answer accuracy: does the model, asked a held-out question, write the reference answer?

For each conversation in a chat-messages file (`{"messages": [..., {"role": "assistant",
"content": ANSWER}]}`, e.g. the demo's sft_heldout.jsonl), the messages before the last
assistant turn are rendered with the model's chat template, an answer is generated greedily
(lmforge.generate, stopping at the end of turn), and it counts as correct when it equals the
reference after normalizing case and whitespace. Unlike multiple choice, this measures whether
the model answers at all, in the expected form.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.errors import DataError, ModelFormatError


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def read_conversations(data_file: str | Path) -> list[tuple[list[dict], str]]:
    """(prompt messages, reference answer) pairs from a chat-messages JSONL file."""
    path = Path(data_file)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise DataError(f"{path}: cannot read: {err.strerror}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line).get("messages")
        except (json.JSONDecodeError, AttributeError):
            raise DataError(f'{path}:{number}: expected {{"messages": [...]}}') from None
        if (
            not isinstance(messages, list)
            or len(messages) < 2
            or not isinstance(messages[-1], dict)
            or messages[-1].get("role") != "assistant"
        ):
            raise DataError(f"{path}:{number}: the conversation must end with an assistant turn")
        rows.append((messages[:-1], str(messages[-1].get("content", ""))))
    if not rows:
        raise DataError(f"{path}: no conversations")
    return rows


def answer_accuracy(
    source: str | Path,
    data_file: str | Path,
    *,
    device: str = "auto",
    dtype: str | None = None,
    max_new_tokens: int = 16,
    batch_size: int = 32,
) -> dict:
    """Share of conversations in `data_file` whose reference answer the model writes.

    Returns:
        {"exact_match", "num_questions", "examples": the first five (question, answer,
        reference)}.
    """
    from lmforge.api import load
    from lmforge.eval.harness import resolve_device
    from lmforge.generate import Generator, SamplingParams
    from lmforge.generate.sequence import encode_prompt

    device_ = resolve_device(device)
    loaded = load(source, device=device_, dtype=dtype)
    if loaded.tokenizer is None:
        raise ModelFormatError(f"{source}: has no tokenizer; answer accuracy needs one")
    rows = read_conversations(data_file)
    prompts = [
        encode_prompt(messages, loaded.tokenizer, vocab_size=loaded.config.vocab_size)
        for messages, _ in rows
    ]
    longest = max(len(ids) for ids in prompts)
    generator = Generator(
        loaded.model,
        loaded.tokenizer,
        max_batch=min(batch_size, len(prompts)),
        max_seq_len=min(loaded.config.max_seq_len, longest + max_new_tokens),
        device=device_,
        compile=False,
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    # All at once: the engine runs batch_size of them and starts the next as rows free up.
    answers = [r.text for r in generator.generate(prompts, params, seed=0).results]
    correct = [_normalize(a) == _normalize(ref) for a, (_, ref) in zip(answers, rows)]
    examples = [
        {"question": messages[-1].get("content", ""), "answer": answer.strip(), "reference": ref}
        for (messages, ref), answer in list(zip(rows, answers))[:5]
    ]
    return {
        "exact_match": sum(correct) / len(correct),
        "num_questions": len(correct),
        "examples": examples,
    }
