"""The embedded demo world: made-up facts, generated deterministically from a seed.

People with invented names each have a home town, a pet and a trade. Pretraining reads the facts
as prose; SFT teaches answering questions about them in the chat format; DPO teaches preferring
the true answer over a false one; held-out questions (about people whose questions were never
trained on, but whose facts the prose told) measure what each stage taught.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SYLLABLES = ["ka", "lo", "mi", "ren", "tu", "sa", "vel", "dor", "ni", "qua", "zel", "bri", "mo", "fen", "ta", "lir"]
TOWNS = ["Kelmora", "Dunvale", "Ostrel", "Penwick", "Saradon", "Tolmere", "Vashti", "Yarrow"]
PETS = ["a heron", "a ferret", "a tortoise", "a goat", "a parrot", "a hedgehog", "a lynx", "an owl"]
TRADES = ["baker", "weaver", "potter", "smith", "sailor", "miller", "glazier", "scribe"]

# (attribute, question, answer template, prose templates)
ATTRIBUTES = {
    "town": (
        "Where does {name} live?",
        "{name} lives in {value}.",
        ["{name} lives in {value}.", "In {value} there is a house where {name} lives.",
         "{name} has always lived in {value}.", "People in {value} often meet {name}."],
    ),
    "pet": (
        "What pet does {name} have?",
        "{name} has {value}.",
        ["{name} has {value}.", "{name} takes care of {value} every day.",
         "Everyone knows that {name} keeps {value}.", "{value} follows {name} around."],
    ),
    "trade": (
        "What is {name}'s trade?",
        "{name} is a {value}.",
        ["{name} is a {value}.", "{name} works as a {value}.",
         "As a {value}, {name} is busy all week.", "The {value} {name} starts work at dawn."],
    ),
}
VALUES = {"town": TOWNS, "pet": PETS, "trade": TRADES}


@dataclass(frozen=True)
class Fact:
    name: str
    attribute: str
    value: str

    @property
    def question(self) -> str:
        return ATTRIBUTES[self.attribute][0].format(name=self.name)

    @property
    def answer(self) -> str:
        return ATTRIBUTES[self.attribute][1].format(name=self.name, value=self.value)


def make_people(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize())
    return sorted(names)


def make_facts(seed: int = 0, num_people: int = 48) -> list[Fact]:
    rng = random.Random(seed)
    return [
        Fact(name, attribute, rng.choice(VALUES[attribute]))
        for name in make_people(rng, num_people)
        for attribute in ATTRIBUTES
    ]


def split_people(facts: list[Fact], held_out_fraction: float = 0.25) -> tuple[set[str], set[str]]:
    names = sorted({f.name for f in facts})
    cut = int(len(names) * (1 - held_out_fraction))
    return set(names[:cut]), set(names[cut:])


def corpus(facts: list[Fact], rng: random.Random, repeats: int) -> list[str]:
    """Prose documents: each a few facts in random templates; every fact appears `repeats`
    times across the corpus, in different wordings."""
    sentences = []
    for fact in facts:
        templates = ATTRIBUTES[fact.attribute][2]
        for i in range(repeats):
            text = templates[(i + rng.randrange(len(templates))) % len(templates)]
            sentences.append(text.format(name=fact.name, value=fact.value))
    rng.shuffle(sentences)
    docs, size = [], 4
    for start in range(0, len(sentences), size):
        docs.append(" ".join(s[0].upper() + s[1:] for s in sentences[start : start + size]))
    return docs


def wrong_value(fact: Fact, rng: random.Random) -> str:
    return rng.choice([v for v in VALUES[fact.attribute] if v != fact.value])


def write_demo_data(out: Path, *, seed: int = 0, num_people: int = 48, repeats: int = 12) -> dict[str, Path]:
    """Write corpus.txt (pretraining prose), sft_train.jsonl / sft_heldout.jsonl (chat
    messages), dpo_train.jsonl / dpo_heldout.jsonl (prompt, chosen, rejected) and
    mc_heldout.jsonl (multiple choice for lm-eval). Returns the paths by name."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    facts = make_facts(seed, num_people)
    train_people, heldout_people = split_people(facts)
    paths = {name: out / file for name, file in [
        ("corpus", "corpus.txt"), ("sft_train", "sft_train.jsonl"), ("sft_heldout", "sft_heldout.jsonl"),
        ("dpo_train", "dpo_train.jsonl"), ("dpo_heldout", "dpo_heldout.jsonl"), ("mc_heldout", "mc_heldout.jsonl"),
    ]}
    paths["corpus"].write_text("\n\n".join(corpus(facts, rng, repeats)) + "\n")
    for split, people in (("train", train_people), ("heldout", heldout_people)):
        chosen = [f for f in facts if f.name in people]
        _write_jsonl(paths[f"sft_{split}"], [
            {"messages": [{"role": "user", "content": f.question}, {"role": "assistant", "content": f.answer}]}
            for f in chosen
        ])
        _write_jsonl(paths[f"dpo_{split}"], [
            {"prompt": f.question, "chosen": f.answer,
             "rejected": Fact(f.name, f.attribute, wrong_value(f, rng)).answer}
            for f in chosen
        ])
    heldout = [f for f in facts if f.name in heldout_people]
    _write_jsonl(paths["mc_heldout"], [_multiple_choice(f, rng) for f in heldout])
    return paths


def _multiple_choice(fact: Fact, rng: random.Random) -> dict:
    options = [fact.value, *rng.sample([v for v in VALUES[fact.attribute] if v != fact.value], 3)]
    rng.shuffle(options)
    choices = [Fact(fact.name, fact.attribute, v).answer for v in options]
    return {"question": fact.question, "choices": choices, "label": options.index(fact.value)}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
