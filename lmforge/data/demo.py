"""The embedded demo world: made-up facts, generated deterministically from a seed.

People with invented names each have a home town, a pet and a trade. Pretraining reads the facts
as prose: many short biographies per person, each telling the person's facts in a random order
and wording (varied wording is what lets a small model store a fact so that it can be asked
about, not just recited in one sentence; train with document masking so that each biography is
read on its own). SFT teaches answering questions in the chat format with a short answer
(`In Ostrel.`) instead of continuing prose, a skill the base model lacks. DPO teaches preferring
the true answer over false ones; GRPO samples answers to the same questions and rewards the
ones that are exactly right (verifiable: the reference answer is known). Instruction data and
preference data ask about different people (three of the training people for SFT, the rest for
DPO and GRPO: pairs and questions are the cheaper data), and a quarter of all people are held
out: their facts were only ever read as prose, so questions about them measure what each stage
taught, not what it memorized.
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
        """The short answer SFT teaches: `In Ostrel.`, `A ferret.`, `A baker.` (the value keeps
        the leading space it has in the prose, so it is the same token the facts were read as)."""
        if self.attribute == "town":
            return f"In {self.value}."
        value = self.value if self.attribute == "pet" else f"a {self.value}"
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
    num_sft_people: int = 3,
) -> dict[str, Path]:
    """Write the demo world's files and return their paths by name:

    corpus.txt (pretraining prose, one document per paragraph), sft_train.jsonl /
    sft_heldout.jsonl (chat messages), dpo_train.jsonl / dpo_heldout.jsonl (prompt, chosen,
    rejected; `train_rejected` / `heldout_rejected` wrong answers per fact), grpo_train.jsonl /
    grpo_heldout.jsonl (a question as a chat and its short answer, for `lmforge grpo`'s
    exact_match reward), mc_heldout.jsonl (multiple choice among four short answers, for
    lm-eval) and prose_heldout.txt (one more biography a person, in orders and wordings of its
    own: held-out perplexity). SFT rows are about the first `num_sft_people` training people,
    DPO and GRPO rows about the other training people.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    facts = make_facts(seed, num_people)
    train_people, heldout_people = split_people(facts)
    # Instruction data and preference data ask about different people (real data sets come
    # from different prompts), and there is much more preference data (pairs are cheap to
    # collect): SFT teaches the answer format on a few people, DPO the right answer on many.
    ordered = sorted(train_people)
    num_sft = min(max(1, num_sft_people), len(ordered) - 1)
    sft_people, dpo_people = set(ordered[:num_sft]), set(ordered[num_sft:])
    paths = {
        name: out / file
        for name, file in [
            ("corpus", "corpus.txt"),
            ("sft_train", "sft_train.jsonl"),
            ("sft_heldout", "sft_heldout.jsonl"),
            ("dpo_train", "dpo_train.jsonl"),
            ("dpo_heldout", "dpo_heldout.jsonl"),
            ("grpo_train", "grpo_train.jsonl"),
            ("grpo_heldout", "grpo_heldout.jsonl"),
            ("mc_heldout", "mc_heldout.jsonl"),
            ("prose_heldout", "prose_heldout.txt"),
        ]
    }
    paths["corpus"].write_text("\n\n".join(corpus(facts, rng, repeats)) + "\n")
    for split, people in (("train", train_people), ("heldout", heldout_people)):
        sft_facts = [f for f in facts if f.name in (sft_people if split == "train" else people)]
        dpo_facts = [f for f in facts if f.name in (dpo_people if split == "train" else people)]
        _write_jsonl(
            paths[f"sft_{split}"],
            [
                {
                    "messages": [
                        {"role": "user", "content": f.question},
                        {"role": "assistant", "content": f.answer},
                    ]
                }
                for f in sft_facts
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
                for f in dpo_facts
                for wrong in wrong_values(f, rng, num_rejected)
            ],
        )
    for split, people in (("train", dpo_people), ("heldout", heldout_people)):
        _write_jsonl(  # (after the rows above: their random draws stay what they were)
            paths[f"grpo_{split}"],
            [
                {"messages": [{"role": "user", "content": f.question}], "answer": f.answer}
                for f in facts
                if f.name in people
            ],
        )
    heldout = [f for f in facts if f.name in heldout_people]
    _write_jsonl(paths["mc_heldout"], [_multiple_choice(f, rng) for f in heldout])
    # one new biography a person (its own random stream: the files above stay as they were)
    held_out_prose = corpus(facts, random.Random(seed + 2), 1)
    paths["prose_heldout"].write_text("\n\n".join(held_out_prose) + "\n")
    return paths


def _multiple_choice(fact: Fact, rng: random.Random) -> dict:
    options = [fact.value, *wrong_values(fact, rng, 3)]
    rng.shuffle(options)
    choices = [Fact(fact.name, fact.attribute, v).answer for v in options]
    return {"question": fact.question, "choices": choices, "label": options.index(fact.value)}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
