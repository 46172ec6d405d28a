"""A missing optional package raises an ImportError that names the extra."""

import sys

import pytest

from leantrain._optional import optional_import
from leantrain.compare.cli import require_compare_extra
from leantrain.compare.report import progress_bar, pyplot
from leantrain.data import load_digits, load_image_folder

INSTALL = 'pip install "leantrain[compare]"'


def test_a_present_package_is_returned():
    module = optional_import("matplotlib.image", "compare")
    assert module.__name__ == "matplotlib.image"


@pytest.mark.parametrize(
    "missing, call",
    [
        ("tqdm", lambda tmp: progress_bar(1, "x")),
        ("matplotlib", lambda tmp: pyplot()),
        ("sklearn", lambda tmp: load_digits()),
        ("matplotlib", lambda tmp: load_image_folder(tmp)),
        ("tqdm", lambda tmp: require_compare_extra()),
        ("matplotlib", lambda tmp: require_compare_extra()),
        ("sklearn", lambda tmp: require_compare_extra()),
    ],
)
def test_a_missing_package_names_the_extra(missing, call, monkeypatch, tmp_path):
    # None in sys.modules: "import name" raises ImportError, as if not installed.
    # Submodules already imported stay cached; the top-level check still refuses.
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(ImportError) as err:
        call(tmp_path)
    message = str(err.value)
    assert INSTALL in message
    distribution = {"sklearn": "scikit-learn"}.get(missing, missing)
    assert distribution in message


def test_the_compare_command_refuses_before_running(monkeypatch, tmp_path):
    from leantrain.cli import main

    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ImportError, match=r"leantrain\[compare\]"):
        main(["compare", "--model", "mlp", "--steps", "1", "--out", str(tmp_path)])
    assert not (tmp_path / "compare.md").exists()
