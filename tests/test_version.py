"""The version is written once (leantrain/__init__.py) and the metadata agrees."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import leantrain
from leantrain.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version_equals_installed_metadata():
    assert leantrain.__version__ == importlib.metadata.version("leantrain")


def test_pyproject_reads_the_version_from_the_package():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', text, re.M)
    assert 'version = { attr = "leantrain.__version__" }' in text
    assert not re.search(r'^version = "', text, re.M)  # no second copy


def test_changelog_has_a_section_for_the_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert f"## [{leantrain.__version__}]" in changelog


def test_leantrain_version_prints_the_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"leantrain {leantrain.__version__}\n"
    # The same through the module, as the console script runs it.
    done = subprocess.run(
        [sys.executable, "-m", "leantrain", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"leantrain {leantrain.__version__}\n"
