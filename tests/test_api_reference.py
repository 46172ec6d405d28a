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


def test_subpackages_are_attributes_of_the_package():
    """``import leantrain; leantrain.optim.Gefen`` works, in a fresh interpreter
    (an earlier test's imports would make it pass here regardless)."""
    import subprocess
    import sys

    code = (
        "import sys, leantrain\n"
        "assert 'leantrain.optim' not in sys.modules  # loaded on first use only\n"
        "assert leantrain.optim.Gefen and leantrain.precond.KfacGradientMaker\n"
        "assert leantrain.layer_parallel.LayerParallel and leantrain.models.GPT\n"
        "assert leantrain.data.load_stdlib_text\n"
        "assert set(leantrain.__all__) <= set(dir(leantrain))\n"
        "try:\n    leantrain.nothing\nexcept AttributeError as e:\n"
        "    assert 'nothing' in str(e)\nelse:\n    raise SystemExit(1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
