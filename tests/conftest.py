"""Shared test settings: deterministic seeds and one intra-op thread.

The CI machine has two cores; one thread per test process keeps timings stable.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    torch.set_num_threads(1)
