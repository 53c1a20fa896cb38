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
