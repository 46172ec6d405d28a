"""Every ```python block of docs/*.md runs as written.

A page's blocks run in order in one fresh namespace (a later block may use what an
earlier one defined), in a temporary working directory. Directives are HTML comments
on the lines just before a block's fence, invisible on the rendered page:

- ``<!-- doc-test: replace "OLD" "NEW" -->`` runs the block with OLD replaced by NEW
  (to shorten a training loop; OLD must occur in the block);
- ``<!-- doc-test: torchrun N NAME -->`` marks the block as part of script NAME, which
  runs on its own under ``torchrun --nproc_per_node N`` (gloo, one thread per
  process); blocks with the same NAME are joined in page order;
- ``<!-- doc-test: falls NAME -->`` asserts after the block that the list ``NAME``
  (the losses the example records) is finite and falls: the mean of its last
  quarter is below that of its first. A loop shortened by ``replace`` keeps enough
  steps for that, so an example that diverges fails its test.

docs/huggingface_lightning.md has its own runner (one namespace per section,
``tests/integrations/test_docs_page.py``); the README's example runs in
``tests/test_readme.py``.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
OWN_RUNNER = {"huggingface_lightning.md"}
FENCE = re.compile(
    r"((?:^<!-- doc-test:[^\n]*-->\n)*)^```python\n(.*?)^```", re.M | re.S
)
DIRECTIVE = re.compile(r"<!-- doc-test: (\w+) (.*?) -->")


FALLS = """
import math as _math, statistics as _stats
_q = max(1, len({name}) // 4)
assert all(_math.isfinite(_v) for _v in {name}), {name}
assert _stats.fmean({name}[-_q:]) < _stats.fmean({name}[:_q]), {name}
"""


@dataclass
class Block:
    code: str
    torchrun: tuple[int, str] | None = None
    replacements: list[tuple[str, str]] = field(default_factory=list)
    falls: list[str] = field(default_factory=list)

    def source(self) -> str:
        code = self.code
        for old, new in self.replacements:
            if old not in code:
                raise AssertionError(f"doc-test replace: {old!r} is not in the block")
            code = code.replace(old, new)
        return code + "".join(FALLS.format(name=name) for name in self.falls)


def parse(text: str) -> list[Block]:
    """The ```python blocks of a page with their directives."""
    blocks = []
    for match in FENCE.finditer(text):
        block = Block(match.group(2))
        for kind, args in DIRECTIVE.findall(match.group(1)):
            if kind == "replace":
                old, new = re.fullmatch(r'"(.*)" "(.*)"', args).groups()
                block.replacements.append((old, new))
            elif kind == "torchrun":
                n, name = args.split()
                block.torchrun = (int(n), name)
            elif kind == "falls":
                block.falls.append(args.strip())
            else:
                raise ValueError(f"unknown doc-test directive {kind!r}")
        blocks.append(block)
    return blocks


PAGES = sorted(
    p.name
    for p in DOCS.glob("*.md")
    if p.name not in OWN_RUNNER and "```python" in p.read_text()
)


def test_parse_reads_directives():
    text = (
        '<!-- doc-test: replace "range(100)" "range(2)" -->\n'
        "```python\nfor i in range(100): pass\n```\n"
        "<!-- doc-test: torchrun 2 demo -->\n```python\nx = 1\n```\n"
    )
    first, second = parse(text)
    assert first.source() == "for i in range(2): pass\n"
    (falling,) = parse("<!-- doc-test: falls xs -->\n```python\nxs = [3, 2, 1]\n```\n")
    exec(falling.source(), {})
    rising = Block("xs = [1, 2, float('nan')]\n", falls=["xs"])
    with pytest.raises(AssertionError):
        exec(rising.source(), {})
    assert second.torchrun == (2, "demo") and second.source() == "x = 1\n"
    with pytest.raises(AssertionError, match="range\\(7\\)"):
        Block("pass\n", replacements=[("range(7)", "")]).source()


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, tmp_path, monkeypatch):
    blocks = parse((DOCS / page).read_text())
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_example"}
    scripts: dict[str, tuple[int, list[str]]] = {}
    for i, block in enumerate(blocks):
        if block.torchrun:
            n, name = block.torchrun
            scripts.setdefault(name, (n, []))[1].append(block.source())
            continue
        exec(compile(block.source(), f"{page}#{i}", "exec"), namespace)
    for name, (n, parts) in scripts.items():
        _torchrun(tmp_path / f"{name}.py", "\n".join(parts), n)


def _bound_and_loaded(code: str) -> tuple[set[str], set[str], set[str]]:
    """Names a block binds by import, binds otherwise, and reads."""
    imported, bound, loaded = set(), set(dir(builtins)), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    return imported, bound, loaded


@pytest.mark.parametrize("page", ["README.md", *PAGES, *OWN_RUNNER])
def test_every_block_imports_what_it_uses(page):
    """A snippet copied on its own must not miss an import: a name that an earlier
    block of the page imports is imported again by each block that uses it. (A
    page's running objects, its ``model`` or ``data``, may come from the block
    that introduces them.)"""
    path = DOCS.parent / page if page == "README.md" else DOCS / page
    imported_before: set[str] = set()
    missing = []
    for i, block in enumerate(parse(path.read_text())):
        imported, bound, loaded = _bound_and_loaded(block.code)
        lacking = (loaded - imported - bound) & imported_before
        if lacking:
            missing.append(f"block {i}: {sorted(lacking)}")
        imported_before |= imported
    assert not missing, f"{page}: blocks use names imported only earlier: {missing}"


def _torchrun(path: Path, code: str, nproc: int) -> None:
    path.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(DOCS.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", str(path)]
    proc = subprocess.run(
        cmd, cwd=path.parent, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
