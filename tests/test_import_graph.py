"""The package's import graph: no cycles, and the walls between its parts hold.

Every module under ``leantrain/`` is parsed with ``ast``; every import statement
anywhere in it (module level, inside functions, in ``TYPE_CHECKING`` blocks),
absolute or relative (``from . import x`` too), is an edge. An import inside a
function hides a cycle from Python's import machinery, not from a reader who
wants to change one of the two modules, so it counts the same. A package's
``__init__`` is a node of its own, named by the package: ``from leantrain.optim
import Gefen`` points at it, ``from leantrain.optim import gefen`` at the
submodule.

What is checked, and why:

- no cycle anywhere in ``leantrain`` (each one is named as a path ``a -> b -> a``),
  ``leantrain.precond``'s included, function-level imports and all: a module that
  imports one importing it back cannot be read, tested or moved alone;
- the three axes (``optim``, ``precond``, ``layer_parallel``) do not import each
  other, so each can be used and changed without the others;
- ``layer_parallel`` (its ``costs/`` included) imports no model and none of the
  ``compare`` extra's packages (matplotlib, tqdm, scikit-learn): the axis is a
  solver; what it times or plots is handed to it by its caller;
- only ``leantrain.compare`` itself and the ``leantrain`` command that dispatches
  to it (``leantrain.cli``) import ``leantrain.compare``: the library does not
  depend on its benchmark app.
"""

from __future__ import annotations

import ast
import pkgutil
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "leantrain"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

AXES = ("leantrain.optim", "leantrain.precond", "leantrain.layer_parallel")
LAYER_PARALLEL_MAY_NOT_IMPORT = ("leantrain.models", "matplotlib", "tqdm", "sklearn")
# The ``leantrain`` command dispatches ``leantrain compare`` to the compare package.
COMPARE_ENTRY_POINTS = ("leantrain.cli",)


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the package at ``root``
    (``__init__`` files named by their package)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join([package, *parts])] = path
    return names


def imported_names(
    name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict
) -> list[str]:
    """The dotted modules an import statement in module ``name`` reads from,
    inside or outside the package: ``from p import m`` reads submodule ``p.m``
    when there is one, else ``p`` itself (a name its ``__init__`` defines).
    Python also runs a parent package's ``__init__`` before any of its
    submodules, an order, not a dependency: no edge."""
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


def imports(names: dict[str, Path] | None = None) -> Iterator[tuple[str, str, int]]:
    """Every ``(importing module, imported dotted name, line)`` of the modules
    ``names`` (by default the package's)."""
    names = module_names() if names is None else names
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported_names(name, path, node, names):
                    yield name, target, node.lineno


def import_graph(names: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """``{module: the modules of ``names`` it imports}`` (by default the package's)."""
    names = module_names() if names is None else names
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, target, _ in imports(names):
        if target in names and target != name:
            graph[name].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` with more than one node
    (Tarjan's algorithm; every cycle lies inside one of them)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def shortest_cycle_through(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest cycle from ``start`` back to it (breadth-first), first = last;
    empty when there is none."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else []
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    return []


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle needed to show each tangle: the shortest cycle through each
    module of each strongly connected component, each cycle once (rotated to
    start at its smallest name)."""
    cycles: list[list[str]] = []
    for component in strongly_connected(graph):
        inside = {node: graph[node] & component for node in component}
        for node in sorted(component):
            cycle = shortest_cycle_through(inside, node)[:-1]
            first = cycle.index(min(cycle))
            cycle = cycle[first:] + cycle[:first] + [cycle[first]]
            if cycle not in cycles:
                cycles.append(cycle)
    return sorted(cycles)


def is_within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "leantrain.precond.curv._base" in graph["leantrain.precond.curv.modules"]
    assert "leantrain.compare.cli" in graph["leantrain.cli"]
    assert len(graph) > 100
    # Every module Python finds in leantrain.precond is a node, so no cycle there
    # goes unseen (this test once stood alone in tests/precond).
    import leantrain.precond

    found = pkgutil.walk_packages(leantrain.precond.__path__, "leantrain.precond.")
    precond = {"leantrain.precond", *(m.name for m in found)}
    assert precond == {m for m in graph if is_within(m, "leantrain.precond")}
    assert len(precond) > 40


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """A package written here: ``a`` imports ``b`` at module level, ``b`` imports
    ``a`` inside a function (Python never trips on it), ``c`` only in a
    ``TYPE_CHECKING`` block, relatively."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
    )
    (tmp_path / "d.py").write_text("import pkg.c\n")
    graph = import_graph(module_names(tmp_path, "pkg"))
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.a"},
        "pkg.c": {"pkg.b"},
        "pkg.d": {"pkg.c"},
    }
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_find_cycles_names_each_cycle():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"e"}, "e": {"d"}}
    assert find_cycles(graph) == [
        ["a", "b", "a"],
        ["a", "b", "c", "a"],
        ["d", "e", "d"],
    ]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_three_axes_do_not_import_each_other():
    crossings = [
        f"{name}:{line} imports {target}"
        for name, target, line in imports()
        for axis in AXES
        if is_within(name, axis)
        for other in AXES
        if other != axis and is_within(target, other)
    ]
    assert not crossings, "; ".join(crossings)


def test_layer_parallel_imports_no_model_and_no_compare_extra():
    found = sorted(
        {
            f"{name}:{line} imports {target}"
            for name, target, line in imports()
            if is_within(name, "leantrain.layer_parallel")
            and any(is_within(target, b) for b in LAYER_PARALLEL_MAY_NOT_IMPORT)
        }
    )
    assert not found, "; ".join(found)


def test_only_the_compare_app_imports_leantrain_compare():
    found = [
        f"{name}:{line} imports {target}"
        for name, target, line in imports()
        if is_within(target, "leantrain.compare")
        and not is_within(name, "leantrain.compare")
        and name not in COMPARE_ENTRY_POINTS
    ]
    assert not found, "; ".join(found)
