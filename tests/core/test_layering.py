"""Imports point one way: the entry points on top, then `sim -> deepinfer <- executors ->
kernels`, with no circle.

The entry points (`deepinfer/entrypoints/`: the offline API, the command line, the
registry of executors by name) and the benchmarks (`benchmarks/`) may import anything.
Below them the rule holds at every level: a module of the core (every other module of
`deepinfer/`), `sim`, `executors` or `kernels` imports nothing it may not, at module
level, inside a function, or by a module name handed to `importlib.import_module`. The
package's face (`deepinfer/__init__.py`, `deepinfer/__main__.py`) may reach the entry
points, so that `from deepinfer import LLM` and `python -m deepinfer` work.

The circle check counts module-level imports only (a function may import lazily what
would otherwise close a circle); `if TYPE_CHECKING:` blocks count, since a circle there
is still a circle a reader must follow.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("deepinfer", "sim", "executors", "kernels", "benchmarks")
ENTRYPOINTS = "deepinfer.entrypoints"
ANYTHING = {"core", "entrypoints", "sim", "executors", "kernels", "benchmarks"}
# layer -> the layers its modules may import, at any level
ALLOWED = {
    "core": {"core"},
    "sim": {"sim", "core"},
    "executors": {"executors", "core", "kernels"},
    "kernels": {"kernels", "core"},
    "entrypoints": ANYTHING,
    "benchmarks": ANYTHING,
}
# The package's face: `from deepinfer import LLM`, `python -m deepinfer`.
FACE = {"deepinfer", "deepinfer.__main__"}
IMPORTERS = {"import_module", "__import__"}
# A module path in a string ("executors.torch_executor:TorchExecutor"): what a registry
# of lazily imported classes holds.
MODULE_STRING = re.compile(r"^([a-z_]+)(\.[a-z_0-9]+)+(:\w+)?$")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    if module == ENTRYPOINTS or module.startswith(ENTRYPOINTS + "."):
        return "entrypoints"
    top = module.split(".")[0]
    return "core" if top == "deepinfer" else top


def _files() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _from_names(stmt: ast.ImportFrom) -> set[str]:
    if not stmt.module or stmt.level:
        return set()
    return {stmt.module} | {f"{stmt.module}.{a.name}" for a in stmt.names}


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
            elif isinstance(stmt, ast.ImportFrom):
                found.update(_from_names(stmt))
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _imports_at_any_depth(path: Path) -> set[str]:
    """Project modules named anywhere in the file: `import` statements at any depth, the
    constant argument of an `importlib.import_module` / `__import__` call (a call with
    any other argument is reported as "<dynamic import>": nobody can check where it
    leads), and strings that spell a project module's path."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.update(_from_names(node))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in IMPORTERS:
                arg = node.args[0] if node.args else None
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
                else:
                    found.add("<dynamic import>")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(
                m.group(0).partition(":")[0] for m in [MODULE_STRING.match(node.value)] if m
            )
    return {m for m in found if m == "<dynamic import>" or m.split(".")[0] in PACKAGES}


def _resolve(imported: str, files: dict[str, Path]) -> str:
    """The module an import names (`from pkg import name` of a symbol: pkg)."""
    while imported and imported not in files:
        imported = imported.rpartition(".")[0]
    return imported


def _graph() -> dict[str, set[str]]:
    files = _files()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = {_resolve(m, files) for m in _top_level_imports(path)}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def layering_violations(files: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, what it imports) for every import against the layering, at any depth."""
    wrong = []
    for name, path in sorted(files.items()):
        allowed = ALLOWED[_layer(name)] | ({"entrypoints"} if name in FACE else set())
        for imported in sorted(_imports_at_any_depth(path)):
            if imported == "<dynamic import>":
                if allowed != ANYTHING:
                    wrong.append((name, imported))
                continue
            target = _resolve(imported, files) or imported
            if _layer(target) not in allowed:
                wrong.append((name, imported))
    return wrong


def test_imports_point_one_way_at_every_level() -> None:
    wrong = layering_violations(_files())
    assert not wrong, f"imports against the layering: {wrong}"


def test_the_check_sees_imports_inside_functions_and_by_name(tmp_path: Path) -> None:
    """What the core once held: a lazy import of the executors inside a function, and a
    registry of executors by module path handed to `importlib.import_module`."""
    (tmp_path / "lazy.py").write_text(
        "def launch():\n    from executors.distributed.launch import launch_data_parallel\n"
    )
    (tmp_path / "registry.py").write_text(
        "import importlib\n"
        '_REGISTRY = {"sim": "sim.sim_executor:SimExecutor"}\n'
        "def get(name):\n"
        '    module, _, attr = _REGISTRY[name].partition(":")\n'
        "    return getattr(importlib.import_module(module), attr)\n"
    )
    (tmp_path / "by_name.py").write_text(
        'import importlib\nK = importlib.import_module("kernels.ops")\n'
    )
    files = {f"deepinfer.{p.stem}": p for p in tmp_path.glob("*.py")}
    assert sorted(layering_violations(files)) == [
        ("deepinfer.by_name", "kernels.ops"),
        ("deepinfer.lazy", "executors.distributed.launch"),
        ("deepinfer.lazy", "executors.distributed.launch.launch_data_parallel"),
        ("deepinfer.registry", "<dynamic import>"),
        ("deepinfer.registry", "sim.sim_executor"),
    ]


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
