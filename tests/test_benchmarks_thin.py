"""Benchmarks, examples and scripts stand on the public API, as a user's code would.

Every ``benchmarks/*.py``, ``examples/*.py`` and ``scripts/*.py`` is parsed with
``ast`` and may neither edit ``sys.path`` (a script that needs another script's
directory on the path holds logic that belongs in the package, where tests cover
it) nor import a private part of leantrain (``leantrain._x``, ``leantrain.x._y``,
``from leantrain.x import _y``): what a script needs from the library is public,
so that a change inside a module cannot silently break a figure in the docs.
Each finding is named by file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("benchmarks", "examples", "scripts")


def is_private(name: str) -> bool:
    """``_x`` is private, ``__x__`` (``__version__``, ``__main__``) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_leantrain_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "leantrain" and any(is_private(p) for p in parts[1:])


def findings(path: Path) -> list[str]:
    """``"file:line what"`` for each ``sys.path`` edit and private leantrain import."""
    where = path.relative_to(ROOT)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            found.append(f"{where}:{node.lineno} uses sys.path")
        elif isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno} imports private {alias.name}"
                for alias in node.names
                if private_leantrain_module(alias.name)
            ]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if private_leantrain_module(node.module):
                found.append(f"{where}:{node.lineno} imports private {node.module}")
            elif node.module.split(".")[0] == "leantrain":
                found += [
                    f"{where}:{node.lineno} imports private {node.module}.{alias.name}"
                    for alias in node.names
                    if is_private(alias.name)
                ]
    return sorted(found, key=lambda f: int(f.split(":")[1].split()[0]))


def scripts() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).glob("*.py"))


def test_the_scan_sees_sys_path_and_private_imports(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    script = tmp_path / "bench.py"
    script.write_text(
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "import leantrain._optional\n"
        "from leantrain.optim._state import new_state\n"
        "from leantrain.precond import _kron\n"
        "from leantrain import __version__\n"
        "from leantrain.optim import Gefen\n"
    )
    assert findings(script) == [
        "bench.py:2 uses sys.path",
        "bench.py:3 imports private leantrain._optional",
        "bench.py:4 imports private leantrain.optim._state",
        "bench.py:5 imports private leantrain.precond._kron",
    ]


def test_there_are_scripts_to_scan():
    assert len(scripts()) > 20


@pytest.mark.parametrize("path", scripts(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_uses_the_public_api_only(path):
    found = findings(path)
    assert not found, "; ".join(found)
