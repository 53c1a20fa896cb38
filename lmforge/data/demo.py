"""The embedded demo world: made-up facts, generated deterministically from a seed.

People with invented names each have a home town, a pet and a trade. Pretraining reads the facts
as prose: many short biographies per person, each telling the person's facts in a random order
and wording (varied wording is what lets a small model store a fact so that it can be asked
about, not just recited in one sentence). SFT teaches answering questions about the facts in the
chat format, with a short answer (`Ostrel.`) that no prose sentence contains, so answering is a
skill the base model lacks. DPO teaches preferring the true answer over a false one. The
held-out questions and pairs are about people whose questions were never trained on, but whose
facts the prose told: they measure what each stage taught, not what it memorized.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "tu",
    "sa",
    "vel",
    "dor",
    "ni",
    "qua",
    "zel",
    "bri",
    "mo",
    "fen",
    "ta",
    "lir",
]
TOWNS = ["Kelmora", "Dunvale", "Ostrel", "Penwick", "Saradon", "Tolmere", "Vashti", "Yarrow"]
PETS = ["a heron", "a ferret", "a tortoise", "a goat", "a parrot", "a hedgehog", "a lynx", "an owl"]
TRADES = ["baker", "weaver", "potter", "smith", "sailor", "miller", "glazier", "scribe"]

# attribute -> (question, prose templates)
ATTRIBUTES = {
    "town": (
        "Where does {name} live?",
        [
            "{name} lives in {value}.",
            "In {value} there is a house where {name} lives.",
            "{name} has always lived in {value}.",
            "People in {value} often meet {name}.",
            "{name}'s home is in {value}.",
            "{name} of {value} came by today.",
        ],
    ),
    "pet": (
        "What pet does {name} have?",
        [
            "{name} has {value}.",
            "{name} takes care of {value} every day.",
            "Everyone knows that {name} keeps {value}.",
            "{value} follows {name} around.",
            "{name} walks with {value} in the evening.",
            "{name} and {value} came by today.",
        ],
    ),
    "trade": (
        "What is {name}'s trade?",
        [
            "{name} is a {value}.",
            "{name} works as a {value}.",
            "As a {value}, {name} is busy all week.",
            "The {value} {name} starts work at dawn.",
            "{name} learned to be a {value} when young.",
            "{name} the {value} came by today.",
        ],
    ),
}
VALUES = {"town": TOWNS, "pet": PETS, "trade": TRADES}
DEFAULT_NUM_PEOPLE = 32
DEFAULT_REPEATS = 16


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
        """The short answer SFT teaches: `Ostrel.`, `A ferret.`, `A baker.`"""
        value = self.value if self.attribute != "trade" else f"a {self.value}"
        return value[0].upper() + value[1:] + "."


def make_people(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize())
    return sorted(names)


def make_facts(seed: int = 0, num_people: int = DEFAULT_NUM_PEOPLE) -> list[Fact]:
    rng = random.Random(seed)
    return [
        Fact(name, attribute, rng.choice(VALUES[attribute]))
        for name in make_people(rng, num_people)
        for attribute in ATTRIBUTES
    ]


def split_people(facts: list[Fact], held_out_fraction: float = 0.25) -> tuple[set[str], set[str]]:
    """Train and held-out people: every fourth name (by sorted order) is held out."""
    names = sorted({f.name for f in facts})
    step = max(2, round(1 / held_out_fraction))
    heldout = {name for i, name in enumerate(names) if i % step == step - 1}
    return set(names) - heldout, heldout


def _sentence(fact: Fact, rng: random.Random) -> str:
    text = rng.choice(ATTRIBUTES[fact.attribute][1]).format(name=fact.name, value=fact.value)
    return text[0].upper() + text[1:]


def corpus(facts: list[Fact], rng: random.Random, repeats: int) -> list[str]:
    """Prose documents: `repeats` short biographies per person, each with all of the person's
    facts in a random order and random wordings; the documents are shuffled."""
    by_person: dict[str, list[Fact]] = {}
    for fact in facts:
        by_person.setdefault(fact.name, []).append(fact)
    docs = []
    for person_facts in by_person.values():
        for _ in range(repeats):
            order = rng.sample(person_facts, len(person_facts))
            docs.append(" ".join(_sentence(fact, rng) for fact in order))
    rng.shuffle(docs)
    return docs


def wrong_values(fact: Fact, rng: random.Random, count: int) -> list[str]:
    return rng.sample([v for v in VALUES[fact.attribute] if v != fact.value], count)


def wrong_value(fact: Fact, rng: random.Random) -> str:
    return wrong_values(fact, rng, 1)[0]


def write_demo_data(
    out: Path,
    *,
    seed: int = 0,
    num_people: int = DEFAULT_NUM_PEOPLE,
    repeats: int = DEFAULT_REPEATS,
    train_rejected: int = 3,
    heldout_rejected: int = 7,
) -> dict[str, Path]:
    """Write the demo world's files and return their paths by name:

    corpus.txt (pretraining prose, one document per paragraph), sft_train.jsonl /
    sft_heldout.jsonl (chat messages), dpo_train.jsonl / dpo_heldout.jsonl (prompt, chosen,
    rejected; `train_rejected` / `heldout_rejected` wrong answers per fact) and mc_heldout.jsonl
    (multiple choice among four short answers, for lm-eval).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    facts = make_facts(seed, num_people)
    train_people, heldout_people = split_people(facts)
    paths = {
        name: out / file
        for name, file in [
            ("corpus", "corpus.txt"),
            ("sft_train", "sft_train.jsonl"),
            ("sft_heldout", "sft_heldout.jsonl"),
            ("dpo_train", "dpo_train.jsonl"),
            ("dpo_heldout", "dpo_heldout.jsonl"),
            ("mc_heldout", "mc_heldout.jsonl"),
        ]
    }
    paths["corpus"].write_text("\n\n".join(corpus(facts, rng, repeats)) + "\n")
    for split, people in (("train", train_people), ("heldout", heldout_people)):
        chosen = [f for f in facts if f.name in people]
        _write_jsonl(
            paths[f"sft_{split}"],
            [
                {
                    "messages": [
                        {"role": "user", "content": f.question},
                        {"role": "assistant", "content": f.answer},
                    ]
                }
                for f in chosen
            ],
        )
        num_rejected = train_rejected if split == "train" else heldout_rejected
        _write_jsonl(
            paths[f"dpo_{split}"],
            [
                {
                    "prompt": f.question,
                    "chosen": f.answer,
                    "rejected": Fact(f.name, f.attribute, wrong).answer,
                }
                for f in chosen
                for wrong in wrong_values(f, rng, num_rejected)
            ],
        )
    heldout = [f for f in facts if f.name in heldout_people]
    _write_jsonl(paths["mc_heldout"], [_multiple_choice(f, rng) for f in heldout])
    return paths


def _multiple_choice(fact: Fact, rng: random.Random) -> dict:
    options = [fact.value, *wrong_values(fact, rng, 3)]
    rng.shuffle(options)
    choices = [Fact(fact.name, fact.attribute, v).answer for v in options]
    return {"question": fact.question, "choices": choices, "label": options.index(fact.value)}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
