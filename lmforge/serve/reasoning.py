"""A thinking model's reasoning split out of its chat answer (`lmforge serve --reasoning-parser`,
vLLM's option of that name): the text it writes between `<think>` and `</think>` goes to the
message's `reasoning` (vLLM's field; in a stream, `reasoning` deltas), the rest to `content` and
to the tool-call parser.

Where the answer starts inside its reasoning:
- "qwen3": where the prompt ends with `<think>` (templates of thinking-only models write it) or
  the answer opens with it (Qwen3's hybrid models do); an answer without either is all content
  (`chat_template_kwargs: {"enable_thinking": false}` renders an empty think block into the
  prompt, and the answer is plain);
- "deepseek_r1": always (its template writes `<think>`, and the model may repeat it).

Newlines right after `</think>` are dropped (the templates write two before the answer). The
split is the same whether the text comes in one piece or token by token: a marker cut between
two pieces is held back until it is whole or cannot be one.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def starts_thinking(parser: str, prompt_text: str) -> bool:
    """Whether an answer to a prompt rendered as `prompt_text` starts inside its reasoning
    (before any `<think>` of its own): see the module docstring."""
    return parser == "deepseek_r1" or prompt_text.rstrip().endswith(OPEN)


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Reads one answer's text, as it comes, into (reasoning, content) pieces. `thinking`:
    the answer starts inside its reasoning (`starts_thinking`); else only where it opens with
    `<think>`."""

    def __init__(self, *, thinking: bool) -> None:
        self.thinking = thinking
        self.state = "start"  # start, reasoning, gap (newlines after </think>), content
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text`, following what was fed before, completes."""
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                opened = self.held.lstrip()
                if opened.startswith(OPEN):
                    self.held, self.state = opened[len(OPEN) :], "reasoning"
                elif OPEN.startswith(opened):  # (whitespace, or a part of the marker)
                    break
                else:
                    self.state = "reasoning" if self.thinking else "content"
            elif self.state == "reasoning":
                end = self.held.find(CLOSE)
                if end < 0:
                    keep = _held_back(self.held, CLOSE)
                    reasoning += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep :]
                    break
                reasoning += self.held[:end]
                self.held, self.state = self.held[end + len(CLOSE) :], "gap"
            elif self.state == "gap":
                self.held = self.held.lstrip("\n")
                if not self.held:
                    break
                self.state = "content"
            else:
                content, self.held = content + self.held, ""
                break
        return reasoning, content

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer's (reasoning, content): `feed` and `finish` at once."""
        (reasoning, content), (last_reasoning, last_content) = self.feed(text), self.finish()
        return reasoning + last_reasoning, content + last_content

    def finish(self) -> tuple[str, str]:
        """The last (reasoning, content), at the end of the answer."""
        rest, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.thinking):
            return rest, ""
        return "", "" if self.state == "gap" else rest
