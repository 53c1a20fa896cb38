"""The README's generated blocks (scripts/update_readme.py) equal what the code prints today:
the demo's held-out counts, the 70B example's memory plans and the QLoRA plan (and the two
planner blocks kept in docs/planning.md). The demo's score table needs a finished run;
tests/test_report.py renders it from its shortened run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location(
        "update_readme", REPO / "scripts" / "update_readme.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


update_readme = load_script()


@pytest.mark.parametrize("name", sorted(update_readme.BLOCKS_WITHOUT_RUN))
def test_readme_block_equals_the_codes_output(name):
    path = update_readme.block_file(name)
    written = update_readme.read_block(path.read_text(), name)
    computed = update_readme.BLOCKS_WITHOUT_RUN[name]() + "\n"
    assert written == computed, f"{path.name} block {name} is stale: run scripts/update_readme.py"


def test_blocks_are_replaced_between_their_markers_only():
    text = "a\n<!-- begin x (note) -->\nold\n<!-- end x -->\nb\n"
    assert update_readme.replace_block(text, "x", "new") == (
        "a\n<!-- begin x (note) -->\nnew\n<!-- end x -->\nb\n"
    )
    with pytest.raises(SystemExit, match="no block 'y'"):
        update_readme.replace_block(text, "y", "new")


def test_the_readme_stays_short_and_names_every_stage():
    """A newcomer's page: two commands first, at most 150 lines, the opening line naming the
    stages the demo runs (GRPO too), and nothing true only on this project's own machines."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    commands = [line.split("#")[0].strip() for line in text.split("```bash\n", 1)[1].splitlines()]
    assert commands[:2] == ["make demo", "make test"]
    opening = text.split("\n\n")[2]
    assert "GRPO" in opening and "DPO" in opening
    assert "this machine" not in text


def test_the_demo_pipelines_header_says_what_its_config_does():
    import tomllib

    text = (REPO / "examples" / "tiny" / "pipeline.toml").read_text()
    people = tomllib.loads(text)["stages"]["world"]["demo"]["num_people"]
    assert f"A made-up world of {people} people" in text
