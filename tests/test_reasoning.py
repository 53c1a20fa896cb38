"""The reasoning split of a thinking model's chat answer (lmforge/serve/reasoning.py): where the
reasoning starts and ends, and the same pieces whether the text comes whole or a character at a
time (markers cut between pieces)."""

from __future__ import annotations

import pytest

from lmforge.serve.reasoning import ReasoningSplitter, starts_thinking

CASES = [
    # (starts thinking, the answer, its reasoning, its content)
    (False, "<think>\nWhy? Because.\n</think>\n\nThe answer.", "\nWhy? Because.\n", "The answer."),
    (False, "  <think>a</think>b", "a", "b"),
    (False, "The answer, no thinking.", "", "The answer, no thinking."),
    (False, "<tool_call>\n{}", "", "<tool_call>\n{}"),  # not a think block
    (False, "<thin", "", "<thin"),  # cut short: content
    (True, "Let me see.\n</think>\n\nYes.", "Let me see.\n", "Yes."),
    (True, "<think>twice opened</think>done", "twice opened", "done"),
    (True, "still thinking when max_tokens came </thi", "still thinking when max_tokens came </thi", ""),
    (False, "<think>a</think>\n\n", "a", ""),
    (False, "<think>x < y </thinking> z</think>ok </think>", "x < y </thinking> z", "ok </think>"),
]  # fmt: skip


@pytest.mark.parametrize("thinking, text, reasoning, content", CASES)
def test_reasoning_and_content_whole_and_a_character_at_a_time(thinking, text, reasoning, content):
    assert ReasoningSplitter(thinking=thinking).split(text) == (reasoning, content)
    streamed = ReasoningSplitter(thinking=thinking)
    pieces = [streamed.feed(char) for char in text] + [streamed.finish()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (reasoning, content)


def test_where_the_answer_starts_thinking():
    assert starts_thinking("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not starts_thinking("qwen3", "<|im_start|>assistant\n")
    assert not starts_thinking("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert starts_thinking("deepseek_r1", "<｜Assistant｜>")
