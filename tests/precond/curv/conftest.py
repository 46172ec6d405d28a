"""Fixtures for the curvature tests; the models live in
``tests/_helpers/curv_models.py``."""

from __future__ import annotations

import pytest

from tests._helpers.curv_models import MODEL_NAMES, Case, make_case


@pytest.fixture(params=MODEL_NAMES)
def case(request) -> Case:
    return make_case(request.param)
