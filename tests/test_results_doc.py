"""docs/results.md holds the current figures; the docs link to files that exist.

The README's "Results at a glance" is a copy of a section of docs/results.md, so a
figure re-measured there must be re-measured here too; results.md stays short enough
to read (history goes to docs/notebook/); and every relative markdown link in
README.md and docs/**/*.md points at a file that exists, and at a heading of it where
the link names one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
MAX_RESULTS_LINES = 300

FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e-?\d+)?")


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section, up to the next level-2 heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _prose(text: str) -> str:
    """Text without code blocks and code spans: what a reader sees as prose."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.*?)#*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_results_are_a_section_of_results_doc():
    glance = _section(README.read_text(), "Results at a glance")
    results = RESULTS.read_text()
    rows = [line for line in glance.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, "the README's results table is gone"
    missing_rows = [row for row in rows if row not in results]
    assert not missing_rows, (
        f"rows of the README's results table not in docs/results.md: {missing_rows}"
    )
    figures = set(NUMBER.findall(LINK.sub("", glance)))
    missing = sorted(figures - set(NUMBER.findall(results)))
    assert not missing, f"README figures not in docs/results.md: {missing}"


def test_results_doc_stays_short():
    lines = RESULTS.read_text().count("\n")
    assert lines <= MAX_RESULTS_LINES, (
        f"docs/results.md has {lines} lines (at most {MAX_RESULTS_LINES}): "
        "move history to a docs/notebook/ page"
    )


def test_notebook_index_lists_every_page():
    notebook = ROOT / "docs" / "notebook"
    index = (notebook / "README.md").read_text()
    pages = sorted(p.name for p in notebook.glob("*.md") if p.name != "README.md")
    assert pages, "docs/notebook/ has no pages"
    for name in pages:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", name), name
        assert f"({name})" in index, f"docs/notebook/README.md does not list {name}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT)}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
