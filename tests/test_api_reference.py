"""docs/api.md is the reference that scripts/api_reference.py writes from the code."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _render() -> str:
    spec = importlib.util.spec_from_file_location(
        "api_reference", ROOT / "scripts" / "api_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render()


def test_api_reference_is_current():
    text = _render()
    assert (ROOT / "docs" / "api.md").read_text() == text, (
        "docs/api.md is stale: run `python scripts/api_reference.py > docs/api.md`"
    )
    assert "- `Gefen(params" in text and "- `LayerParallel(" in text
