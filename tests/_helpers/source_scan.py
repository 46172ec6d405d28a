"""The library's source as (enclosing function, node) pairs, for the static checks.

Shared by ``test_device_follows_tensors.py`` (tensor factories without ``device=``)
and ``test_host_syncs.py`` (host reads in a steady step): both name a finding by
its file under ``leantrain/``, the dotted name of the functions and classes around
it (``"Gefen.step"``, ``"mgrit_solve.norm"``; ``"<module>"`` at top level) and what
was found, so their lists of allowed findings read the same way.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "leantrain"

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def scoped_nodes(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Every node of ``tree`` with the dotted name of its enclosing scopes."""

    def visit(node: ast.AST, scope: tuple[str, ...]) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            inner = (*scope, child.name) if isinstance(child, _SCOPES) else scope
            yield ".".join(scope) or "<module>", child
            yield from visit(child, inner)

    return visit(tree, ())


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def enclosing_function(path: str | Path, lineno: int) -> str:
    """The dotted name of the innermost function or class holding line ``lineno``
    of ``path`` (``"<module>"`` outside any)."""
    best, best_span = "<module>", None
    for scope, node in scoped_nodes(parse(Path(path))):
        if isinstance(node, _SCOPES) and node.lineno <= lineno <= node.end_lineno:
            span = node.end_lineno - node.lineno
            if best_span is None or span <= best_span:
                name = node.name if scope == "<module>" else f"{scope}.{node.name}"
                best, best_span = name, span
    return best


def assert_listed(
    found: dict[tuple[str, str, str], list[int]],
    allowed: dict[tuple[str, str, str], str],
    *,
    what: str,
    table: str,
    fix: str,
) -> None:
    """Every ``(file, function, kind)`` found is in ``allowed`` (with its reason),
    and every entry of ``allowed`` is still found (no stale reasons)."""
    unlisted = {k: v for k, v in found.items() if k not in allowed}
    where = [f"{f}:{lines} in {fn}: {k}" for (f, fn, k), lines in unlisted.items()]
    assert not unlisted, (
        f"{what} ({fix}, or list it in {table} with the reason): " + "; ".join(where)
    )
    stale = sorted(set(allowed) - set(found))
    assert not stale, f"{table} lists calls that are gone: {stale}"
