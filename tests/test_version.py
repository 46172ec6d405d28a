"""The version is written once (leantrain/__init__.py) and the metadata agrees."""

import importlib.metadata
import re
from pathlib import Path

import leantrain

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
