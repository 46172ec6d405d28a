"""Shared test settings: deterministic seeds, one intra-op thread, Triton's
interpreter on machines without CUDA.

The CI machine has two cores; one thread per test process keeps timings stable.
"""

import os

import pytest
import torch

# Triton's interpreter runs Gefen's GPU kernels on CPU tensors
# (tests/optim/test_triton_step.py). Triton decides when it is first imported
# whether its kernels (its own reductions too) are compiled or interpreted, so the
# switch is set here, before anything imports triton, and only where no CUDA
# device could compile them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ABSENT = object()


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


@pytest.fixture
def set_attribute():
    """``set_attribute(obj, name, value)``, undone after the test exactly as found.

    pytest's ``monkeypatch.setattr`` restores what it saw in ``obj.__dict__``; a
    torch config module keeps its options elsewhere, so since pytest 9.2 the undo
    deletes the option for the rest of the process. This reads and restores the
    attribute itself (``getattr``/``setattr``), and removes it only if it was
    absent.
    """
    undo = []

    def set_(obj, name, value):
        undo.append((obj, name, getattr(obj, name, _ABSENT)))
        setattr(obj, name, value)

    yield set_
    for obj, name, old in reversed(undo):
        if old is _ABSENT:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def pytest_configure(config):
    torch.set_num_threads(1)
