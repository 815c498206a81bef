"""The package's layers: engines above methods and data, no method importing an engine, no import circles."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "workbench"
LOWER = ("workbench.methods", "workbench.federation", "workbench.data", "workbench.backbones",
         "workbench.linalg", "workbench.registry")
UPPER = ("workbench.engines", "workbench.experiment", "workbench.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The workbench modules a file imports at run time, at module level or inside functions
    (not those under `if TYPE_CHECKING:`, which are for annotations only)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("workbench")}


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {name: {target for target in imports(path) if target in MODULES and target != name}
         for name, path in MODULES.items()}


@pytest.mark.parametrize("lower", LOWER)
def test_methods_data_and_the_wire_never_import_an_engine(lower):
    offenders = {name: sorted(target for target in targets if target.startswith(UPPER))
                 for name, targets in GRAPH.items() if name.startswith(lower)}
    assert not {name: found for name, found in offenders.items() if found}


def test_there_is_no_import_circle():
    """Between modules (a package's `__init__` re-exporting its own modules is not a circle)."""
    def edges(name):
        return {target for target in GRAPH[name] if not name.startswith(f"{target}.")}

    state: dict[str, str] = {}

    def visit(name, trail):
        state[name] = "open"
        for target in edges(name):
            if state.get(target) == "open":
                raise AssertionError("import circle: " + " -> ".join([*trail[trail.index(target):], target]))
            if target not in state:
                visit(target, [*trail, target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
