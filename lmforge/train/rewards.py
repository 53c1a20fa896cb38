"""Verifiable rewards for online RL (`lmforge grpo`): programs that score a completion.

Each `[[grpo.rewards]]` entry is one reward with a weight; a completion's reward is the weighted
sum. Built in:

* `exact_match`: 1 when the completion equals the row's reference field after normalisation
  (case, surrounding whitespace and punctuation, runs of spaces), else 0;
* `numeric_match`: 1 when the completion's answer number equals the reference's: the last
  `\\boxed{...}`, else the number after the last `####` (GSM8K), else the last number;
* `regex`: 1 when `pattern` is found in the completion (a format reward), else 0;
* `length_penalty`: DAPO's soft overlong punishment (Yu et al., 2025, eq. 13): 0 up to
  `max_tokens - buffer` completion tokens, then falling linearly to -1 at `max_tokens`, -1
  beyond;
* `python`: a function of the user's, `function = "path/to/file.py:name"`, called as
  `name(completion: str, sample: dict) -> float` (`sample`: the row's fields, the prompt among
  them). This is the user's own code, run in the training process: it is loaded from that file
  path only (never from a module name or a checkpoint) and only when the config names it.

`exact_match` and `numeric_match` are correctness checks: the `accuracy` metric is the fraction
of completions that all of a job's correctness checks pass.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import re
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import PositiveInt, model_validator

from lmforge.config import Section
from lmforge.errors import ConfigError, UserError

CORRECTNESS_KINDS = ("exact_match", "numeric_match")


class RewardSection(Section):
    """One reward of `[[grpo.rewards]]`."""

    kind: Literal["exact_match", "numeric_match", "regex", "length_penalty", "python"]
    weight: float = 1.0
    name: str = ""
    """The metric's name (`reward/<name>`); default: the kind (the function's name for python)."""
    field: str = "answer"
    """The row's field holding the reference answer (exact_match, numeric_match)."""
    pattern: str = ""
    """regex: a Python regular expression searched for in the completion."""
    function: str = ""
    """python: `path/to/file.py:function_name` (user code, loaded from that path only)."""
    max_tokens: PositiveInt | None = None
    """length_penalty: the length punished fully (default: grpo.max_new_tokens)."""
    buffer: PositiveInt = 16
    """length_penalty: the tokens before `max_tokens` over which the penalty grows to -1."""

    @model_validator(mode="after")
    def _check_kind_settings(self) -> RewardSection:
        if self.kind == "regex":
            if not self.pattern:
                raise ValueError("a regex reward needs `pattern`")
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(
                    f"pattern {self.pattern!r} is not a regular expression: {err}"
                ) from None
        if self.kind == "python" and not _split_function(self.function):
            raise ValueError(
                f"a python reward needs function = 'path/to/file.py:function_name', got "
                f"{self.function!r}"
            )
        return self

    @property
    def metric_name(self) -> str:
        if self.name:
            return self.name
        if self.kind == "python":
            return _split_function(self.function)[1]
        return self.kind


@dataclass(frozen=True)
class Completion:
    """What a reward sees of one completion."""

    text: str  # the new text (cut before a stop string)
    num_tokens: int  # tokens generated (a final stop token included)
    sample: dict[str, Any]  # the prompt row's fields
    where: str = ""  # the row's file:line, for errors
    token_ids: tuple[int, ...] = ()  # as generated (for rewards built in code, on token ids)


# ---- built-in checks -----------------------------------------------------------------------

_PUNCTUATION = string.punctuation + "“”‘’"


def normalize_text(text: str) -> str:
    """Lower case, runs of whitespace as one space, punctuation stripped from both ends."""
    return " ".join(text.lower().split()).strip(_PUNCTUATION + " ")


_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"


def _to_number(text: str) -> float | None:
    found = re.findall(_NUMBER, text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def extract_number(text: str) -> float | None:
    """The answer number of a text: the last \\boxed{}, else after the last ####, else the last
    number in it; None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return _to_number(boxed)
    if "####" in text:
        return _to_number(text.rsplit("####", 1)[1])
    return _to_number(text)


def numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def overlong_penalty(num_tokens: int, *, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0, then linear down to -1 over the last `buffer`."""
    free = max_tokens - buffer
    if num_tokens <= free:
        return 0.0
    if num_tokens <= max_tokens:
        return (free - num_tokens) / buffer
    return -1.0


# ---- rewards as callables ------------------------------------------------------------------


class RewardError(UserError):
    """A reward that cannot be loaded, or failed or returned a non-number for a sample."""


def _split_function(value: str) -> tuple[str, str] | None:
    path, colon, name = value.rpartition(":")
    if not colon or not path or not name.isidentifier():
        return None
    return path, name


def load_user_function(spec: str) -> Callable[[str, dict], Any]:
    """The function `path.py:name` from the Python file at `path` (user code: executed)."""
    split = _split_function(spec)
    if split is None:
        raise RewardError(f"reward function {spec!r}: expected 'path/to/file.py:function_name'")
    path, name = Path(split[0]).expanduser(), split[1]
    if not path.is_file():
        raise RewardError(f"reward function {spec!r}: {path} is not a file")
    # A module name of the file's own (dataclasses and pickling look modules up by name).
    module_name = f"lmforge_reward_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward function {spec!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's code: any error is theirs to see
        del sys.modules[module_name]
        raise RewardError(
            f"reward function {spec!r}: importing {path} failed: {type(err).__name__}: {err}"
        ) from err
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(f"reward function {spec!r}: {path} defines no function {name!r}")
    return function


@dataclass
class Reward:
    """One configured reward: `score(completion) -> float`."""

    name: str
    weight: float
    checks_correctness: bool
    score_fn: Callable[[Completion], Any]
    description: str  # for errors: the kind, or the user function's spec

    def score(self, completion: Completion) -> float:
        try:
            value = self.score_fn(completion)
        except UserError:
            raise
        except Exception as err:
            raise RewardError(
                f"reward {self.description} failed on sample {completion.where or '?'}: "
                f"{type(err).__name__}: {err}"
            ) from err
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise RewardError(
                f"reward {self.description} returned {value!r} for sample "
                f"{completion.where or '?'}; a reward must be a finite number"
            )
        return float(value)


def _reference(completion: Completion, field: str) -> Any:
    if field not in completion.sample:
        keys = ", ".join(map(str, list(completion.sample)[:10])) or "none"
        raise RewardError(
            f"sample {completion.where or '?'} has no field {field!r} for its reference answer "
            f"(fields: {keys}); set the reward's `field`"
        )
    return completion.sample[field]


def build_reward(section: RewardSection, *, max_new_tokens: int) -> Reward:
    """The callable of one `[[grpo.rewards]]` entry (a python reward's file is loaded here)."""
    kind, field = section.kind, section.field
    if kind == "exact_match":

        def score(c: Completion) -> float:
            return float(normalize_text(c.text) == normalize_text(str(_reference(c, field))))

    elif kind == "numeric_match":

        def score(c: Completion) -> float:
            reference = _reference(c, field)
            expected = float(reference) if isinstance(reference, int | float) else None
            if expected is None:
                expected = extract_number(str(reference))
            return float(numbers_equal(extract_number(c.text), expected))

    elif kind == "regex":
        pattern = re.compile(section.pattern)

        def score(c: Completion) -> float:
            return float(pattern.search(c.text) is not None)

    elif kind == "length_penalty":
        max_tokens = section.max_tokens or max_new_tokens
        if section.buffer > max_tokens:
            raise ConfigError(
                f"length_penalty: buffer {section.buffer} exceeds max_tokens {max_tokens}"
            )

        def score(c: Completion) -> float:
            return overlong_penalty(c.num_tokens, max_tokens=max_tokens, buffer=section.buffer)

    else:
        function = load_user_function(section.function)

        def score(c: Completion) -> Any:
            return function(c.text, c.sample)

    description = f"{section.function!r}" if kind == "python" else f"{section.metric_name!r}"
    return Reward(
        name=section.metric_name,
        weight=section.weight,
        checks_correctness=kind in CORRECTNESS_KINDS,
        score_fn=score,
        description=description,
    )


def build_rewards(sections: Sequence[RewardSection], *, max_new_tokens: int) -> list[Reward]:
    rewards = [build_reward(s, max_new_tokens=max_new_tokens) for s in sections]
    names = [r.name for r in rewards]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"two grpo.rewards are named {duplicate!r}; give each a distinct `name`")
    return rewards


@dataclass
class Scores:
    """Rewards of a batch of completions."""

    total: list[float]  # the weighted sum, per completion
    by_reward: dict[str, list[float]]  # each reward's own values, per completion
    correct: list[bool] | None  # all correctness checks passed (None: no such reward)


def score_completions(rewards: Sequence[Reward], completions: Sequence[Completion]) -> Scores:
    by_reward = {r.name: [r.score(c) for c in completions] for r in rewards}
    total = [
        math.fsum(r.weight * by_reward[r.name][i] for r in rewards) for i in range(len(completions))
    ]
    checks = [r for r in rewards if r.checks_correctness]
    correct = None
    if checks:
        correct = [
            all(by_reward[r.name][i] == 1.0 for r in checks) for i in range(len(completions))
        ]
    return Scores(total=total, by_reward=by_reward, correct=correct)
