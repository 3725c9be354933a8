"""Imports point one way, `sim -> deepinfer <- executors -> kernels`, with no circle.

Only module-level imports count (a CLI command may import the simulator inside its
function); `if TYPE_CHECKING:` blocks count too, since a circle there is still a circle
a reader must follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("deepinfer", "sim", "executors", "kernels")
# package -> the project packages its modules may import at module level
ALLOWED = {
    "deepinfer": {"deepinfer"},
    "sim": {"sim", "deepinfer"},
    "executors": {"executors", "deepinfer", "kernels"},
    "kernels": {"kernels", "deepinfer"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """Project modules imported outside any function or class body."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        stmts = [node]
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` and the like
            stmts = list(node.body) + list(node.orelse)
        for stmt in stmts:
            if isinstance(stmt, ast.Import):
                found.update(a.name for a in stmt.names)
            elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                found.add(stmt.module)
                found.update(f"{stmt.module}.{a.name}" for a in stmt.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for imported in _top_level_imports(path):
            while imported and imported not in files:  # `from pkg import name` of a symbol
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def test_imports_point_one_way() -> None:
    wrong = [
        (m, t)
        for m, targets in _graph().items()
        for t in targets
        if t.split(".")[0] not in ALLOWED[m.split(".")[0]]
    ]
    assert not wrong, f"imports against the layering: {wrong}"


def test_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            # A package's __init__ importing its own submodules is not a circle of modules.
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
