"""The Python examples of docs/huggingface_lightning.md run as written.

Each ``## `` section's ```python blocks run in order in one fresh namespace, so a later
block may use what an earlier block of the same section defined. A section without
blocks is not an error here; the page's own text says what each section covers.
"""

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "huggingface_lightning.md"


def _sections() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    for part in re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        blocks = re.findall(r"```python\n(.*?)```", body, re.S)
        if blocks:
            sections[title.strip()] = blocks
    return sections


SECTIONS = _sections()


@pytest.mark.parametrize("title", sorted(SECTIONS) or ["(no examples yet)"])
def test_section_examples_run(title, tmp_path, monkeypatch):
    if title not in SECTIONS:
        pytest.skip("the page has no Python examples")
    monkeypatch.chdir(tmp_path)  # trainers write checkpoints to the working directory
    namespace: dict = {"__name__": "docs_example"}
    for i, code in enumerate(SECTIONS[title]):
        exec(compile(code, f"{PAGE.name}[{title}#{i}]", "exec"), namespace)
