"""Shared test settings: deterministic seeds and one intra-op thread.

The CI machine has two cores; one thread per test process keeps timings stable.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _one_thread():
    # One intra-op thread in every test, and back to it after a test that sets its
    # own: tiny tensors gain nothing from two threads on the shared 2-core machine.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def pytest_configure(config):
    torch.set_num_threads(1)
