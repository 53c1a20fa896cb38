"""docs/architecture.md's allowed arrows hold in the code: every import of one lmforge package by
another (`import lmforge.X`, `from lmforge.X import ...`, `from lmforge import X`, relative
imports; at module level, under TYPE_CHECKING or inside a function) goes along an arrow the
doc's table allows, or is one of KNOWN below. Each top-level name in lmforge/ belongs to one
unit of the table, so a new package has to be placed before it can import anything."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lmforge"
DOC = REPO / "docs" / "architecture.md"

# Arrows that exist today against the table, each with where it is and why it is not allowed.
# Remove an entry when its import goes; add none without a line in docs/architecture.md.
KNOWN = {
    # models/llama/model.py's forward(labels=) calls the fused output loss in
    # modules/cross_entropy.py (a function-level import).
    ("models", "modules"),
    # modules/cross_entropy.py takes IGNORE_INDEX from data/sft.py.
    ("modules", "data"),
    # api.py reads quantized weights through quantize/stored.py, a leaf that imports nothing
    # above api; the package-level cycle goes when that reader moves below api.
    ("api", "quantize"),
    # eval/stage.py reads its settings section from pipeline/kinds.py.
    ("eval", "pipeline"),
}


def allowed_arrows() -> tuple[dict[str, str], dict[str, set[str]]]:
    """From the doc's "Allowed arrows" table: each top-level name's unit, and each unit's
    allowed imports. A row: | unit | members (top-level names) | what it owns | may import |."""
    section = DOC.read_text().split("## Allowed arrows", 1)[1].split("\n## ", 1)[0]
    unit_of: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        unit = cells[0].strip("`/")
        members = re.findall(r"`([\w/]+?)/?`", cells[1])
        for member in members:
            assert member not in unit_of, f"{member} is in two rows of the table"
            unit_of[member] = unit
        allowed[unit] = set(re.findall(r"`([\w/]+?)/?`", cells[3]))
    return unit_of, allowed


def imported(path: Path) -> list[tuple[str, int]]:
    """(top-level lmforge name, line) of every lmforge import in `path`."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's package, up level - 1
                package = ["lmforge", *parts[:-1]]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "lmforge":  # from lmforge import X: X is a top-level name
                names += [(f"lmforge.{alias.name}", node.lineno) for alias in node.names]
            else:
                names.append((base, node.lineno))
    return [
        (name.split(".")[1], line)
        for name, line in names
        if name.startswith("lmforge.") and len(name.split(".")) > 1
    ]


def test_the_table_places_every_top_level_name():
    unit_of, allowed = allowed_arrows()
    names = {p.stem for p in PACKAGE.glob("*.py")} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
    }
    assert names - set(unit_of) == set(), "docs/architecture.md: place these in the table"
    for unit, targets in allowed.items():
        assert targets <= set(allowed), f"{unit} may import unknown units {targets - set(allowed)}"
    assert {arrow for arrow in KNOWN if arrow[1] in allowed[arrow[0]]} == set(), (
        "a KNOWN arrow is allowed by the table: drop it from KNOWN"
    )


def test_every_import_between_packages_goes_along_an_allowed_arrow():
    unit_of, allowed = allowed_arrows()
    wrong, seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of[path.relative_to(PACKAGE).parts[0].removesuffix(".py")]
        for name, line in imported(path):
            target = unit_of.get(name)
            if target is None or target == source or target in allowed[source]:
                continue
            seen.add((source, target))
            if (source, target) not in KNOWN:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {source} -> {target} ({name})")
    assert wrong == [], "imports the table of docs/architecture.md does not allow:\n" + "\n".join(
        wrong
    )
    assert seen >= KNOWN, f"KNOWN arrows no import takes any more (drop them): {KNOWN - seen}"


def test_imports_are_found_in_every_form(tmp_path):
    package = tmp_path / "lmforge"
    (package / "train").mkdir(parents=True)
    source = package / "train" / "loop.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import lmforge.models.llama\n"
        "from lmforge.data import sft\n"
        "from lmforge import generate, errors\n"
        "from ..modules import lora\n"
        "from . import losses\n"
        "if TYPE_CHECKING:\n    from lmforge.plan import memory\n"
        "def f():\n    from lmforge.eval import harness\n"
    )
    globals()["PACKAGE"] = package
    try:
        found = [name for name, _ in imported(source)]
    finally:
        globals()["PACKAGE"] = REPO / "lmforge"
    assert sorted(found) == sorted(
        ["models", "data", "generate", "errors", "modules", "train", "plan", "eval"]
    )
