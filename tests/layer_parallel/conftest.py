"""Small test steps for the layer-parallel tests (models come from leantrain.models)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: two intra-op threads only fight over the shared 2-core machine.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
