"""Fixtures of the model tests."""

import pytest
import torch


@pytest.fixture
def seeded():
    """Seed the global RNG, so model initialisation is the same on every run."""
    torch.manual_seed(0)
