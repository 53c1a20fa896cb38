"""The package's import graph: no circles, and data/ never reaches up into train/.

Every import counts: those inside functions (a lazy import hides a circle, it does not remove
it) and those under `if TYPE_CHECKING:` (a circle for the reader and the type checker, even
if it never runs): the imported module defines what it needs instead (a Protocol, a small data
type), or the decision moves above both.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lmforge"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the lmforge modules it imports."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                found = owner(target) if target.startswith("lmforge") else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_data_does_not_import_train():
    graph = import_graph()
    upward = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("lmforge.data")
        for target in targets
        if target.startswith("lmforge.train")
    }
    assert upward == set()


def test_inference_and_training_meet_only_below_both():
    """generate/ reaches nothing of train/ (what both need lives in lmforge.parallel), and
    train/ nothing of the planner (which reads train's job configs: the command hands the
    trainer the planner's decision)."""
    graph = import_graph()
    upward = {
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if (module.startswith("lmforge.generate") and target.startswith("lmforge.train"))
        or (
            module.startswith(("lmforge.train", "lmforge.parallel"))
            and target.startswith("lmforge.plan")
        )
        or (module.startswith("lmforge.parallel") and target.startswith("lmforge.train"))
    }
    assert upward == set()


def test_type_level_and_lazy_imports_count(tmp_path, monkeypatch):
    """An import under `if TYPE_CHECKING:` and one inside a function are arrows too."""
    package = tmp_path / "lmforge"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmforge.b import B\n"
    )
    (package / "b.py").write_text("def f():\n    from lmforge import a\n")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert circles(import_graph()) == [["lmforge.a", "lmforge.b"]]


def test_a_planted_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_by_string():
    """`importlib.import_module("lmforge.x")` hides an arrow from the walk above (and from a
    reader who wants to jump to it): components are imported by name."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            called = node.func if isinstance(node, ast.Call) else None
            text = ast.unparse(called) if called is not None else ""
            if text in ("importlib.import_module", "import_module", "__import__"):
                found.append(f"{name}:{node.lineno}")
    assert found == []


def test_arrows_point_down():
    """The command line sits on top: no library module imports it. The run-directory records
    (lmforge.manifest) sit at the bottom, so that the report and `status` read them without
    the pipeline: they import nothing of lmforge's, and report/ never imports pipeline/."""
    graph = import_graph()
    entry = ("lmforge.cli", "lmforge.commands", "lmforge.__main__")
    upward = {
        (module, target)
        for module, targets in graph.items()
        if not module.startswith(entry)
        for target in targets
        if target.startswith(entry)
    }
    assert upward == set()
    assert graph["lmforge.manifest"] == set()
    report = {t for m, ts in graph.items() if m.startswith("lmforge.report") for t in ts}
    assert not {t for t in report if t.startswith("lmforge.pipeline")}


def _family_packages() -> set[str]:
    models = PACKAGE / "models"
    return {f"lmforge.models.{p.name}" for p in models.iterdir() if (p / "__init__.py").exists()}


def test_only_models_imports_a_family_by_name():
    families = _family_packages()
    assert {"lmforge.models.llama", "lmforge.models.qwen3"} <= families
    by_name = {
        (module, target)
        for module, targets in import_graph().items()
        if not module.startswith("lmforge.models")
        for target in targets
        if any(target == f or target.startswith(f + ".") for f in families)
    }
    assert by_name == set()
