"""No import cycle inside ``leantrain.precond``, not even through imports inside
functions (which hide a cycle from Python's import machinery, not from a reader).

Every module under ``leantrain/precond`` is parsed with ``ast``; every import
statement anywhere in it (module level, in functions, in ``TYPE_CHECKING``
blocks) that names a ``leantrain.precond`` module, absolutely or relatively, is an
edge. A package's ``__init__`` is a node of its own (named by the package):
``from leantrain.precond import x`` points at it unless ``x`` is a submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "leantrain.precond"
ROOT = Path(__file__).resolve().parents[2] / "leantrain" / "precond"


def module_names() -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package (``__init__`` files
    named by their package)."""
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join([PACKAGE, *parts])] = path
    return names


def resolve(
    name: str, path: Path, node: ast.ImportFrom | ast.Import, modules: dict
) -> list[str]:
    """The package modules an import statement in module ``name`` reads from:
    ``from p import m`` reads submodule ``p.m`` when there is one, else ``p``
    itself (a name its ``__init__`` defines). Python also runs a parent package's
    ``__init__`` before any of its submodules, an order, not a dependency: no edge."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
        for alias in node.names
    ]


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in resolve(name, path, node, names):
                if target in names and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first = last), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert f"{PACKAGE}.curv._base" in graph[f"{PACKAGE}.curv.modules"]  # relative
    assert len(graph) > 40


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_precond():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
