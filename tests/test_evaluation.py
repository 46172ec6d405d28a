"""leantrain.evaluation: the marks nest, survive exceptions and count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from leantrain import evaluation


def test_marks_nest_and_are_restored_after_an_exception():
    assert not evaluation.is_auxiliary() and not evaluation.in_detached()
    before = evaluation.detached_count()
    with pytest.raises(KeyError), evaluation.detached():
        assert evaluation.in_detached()
        with evaluation.auxiliary():
            with evaluation.auxiliary():
                assert evaluation.is_auxiliary()
            # auxiliary wins: a detached graph re-evaluated for another purpose
            assert evaluation.is_auxiliary() and not evaluation.in_detached()
        raise KeyError("inside")
    assert not evaluation.is_auxiliary() and not evaluation.in_detached()
    assert evaluation.detached_count() == before + 1


def test_partial_count_counts_notes():
    before = evaluation.partial_count()
    evaluation.note_partial()
    evaluation.note_partial()
    assert evaluation.partial_count() == before + 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputation_names_checkpointing_re_runs(reentrant):
    seen = []
    layer = torch.nn.Linear(3, 3)
    layer.register_forward_hook(lambda *_: seen.append(evaluation.recomputation()))
    x = torch.randn(2, 3, requires_grad=True)

    def block(z):
        return torch.tanh(layer(z))  # tanh's saved output must be rebuilt

    checkpoint(block, x, use_reentrant=reentrant).sum().backward()
    layer(x)  # an ordinary forward
    kind = "reentrant" if reentrant else "non_reentrant"
    # A reentrant checkpoint's first forward runs without gradients.
    assert seen == [None, kind, None]
