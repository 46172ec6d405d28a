"""Every ```python block of docs/*.md runs as written.

A page's blocks run in order in one fresh namespace (a later block may use what an
earlier one defined), in a temporary working directory. Directives are HTML comments
on the lines just before a block's fence, invisible on the rendered page:

- ``<!-- doc-test: replace "OLD" "NEW" -->`` runs the block with OLD replaced by NEW
  (to shorten a training loop; OLD must occur in the block);
- ``<!-- doc-test: torchrun N NAME -->`` marks the block as part of script NAME, which
  runs on its own under ``torchrun --nproc_per_node N`` (gloo, one thread per
  process); blocks with the same NAME are joined in page order.

docs/huggingface_lightning.md has its own runner (one namespace per section,
``tests/integrations/test_docs_page.py``); the README's example runs in
``tests/test_readme.py``.
"""

from __future__ import annotations

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


@dataclass
class Block:
    code: str
    torchrun: tuple[int, str] | None = None
    replacements: list[tuple[str, str]] = field(default_factory=list)

    def source(self) -> str:
        code = self.code
        for old, new in self.replacements:
            if old not in code:
                raise AssertionError(f"doc-test replace: {old!r} is not in the block")
            code = code.replace(old, new)
        return code


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


def _torchrun(path: Path, code: str, nproc: int) -> None:
    path.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(DOCS.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", str(path)]
    proc = subprocess.run(
        cmd, cwd=path.parent, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
