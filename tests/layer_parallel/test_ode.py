"""Per-layer random streams and the forward propagator's level steps."""

from __future__ import annotations

import torch

from leantrain.layer_parallel import LayerRNG, StepPropagator
from tests._helpers.lp_steps import tanh_steps


def test_layer_streams_repeat_and_differ():
    rng = LayerRNG(11)
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(64)
    with rng.layer(2):
        a = drop(x)
    with rng.layer(2):
        b = drop(x)
    with rng.layer(3):
        c = drop(x)
    with LayerRNG(12).layer(2):
        d = drop(x)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_global_stream_untouched_except_one_draw():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with LayerRNG(1).layer(0):
        torch.rand(100)  # inside the fork
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(0)
    LayerRNG.draw(torch.zeros(1), enabled=False)  # evaluation: no draw at all
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(0)
    r1 = LayerRNG.draw(torch.zeros(1), enabled=True)
    torch.manual_seed(0)
    r2 = LayerRNG.draw(torch.zeros(1), enabled=True)
    assert r1.batch_seed == r2.batch_seed  # reproducible under the global seed
    assert r1.seed(0) != r1.seed(1) and 0 <= r1.seed(0) < 2**63


def test_level_steps_use_interval_start_layer_and_scaled_dt():
    steps = tanh_steps(16, 3)
    prop = StepPropagator(steps, 1 / 16, 4, LayerRNG(0, enabled=False))
    u = torch.randn(3, dtype=torch.float64)
    for level, j in [(0, 5), (1, 3), (2, 1)]:
        n, dt = (j - 1) * 4**level, 4**level / 16
        assert torch.equal(prop(level, j, u), steps[n](u, dt))


def test_final_sweep_records_one_graph_per_layer():
    steps = tanh_steps(4, 2)
    prop = StepPropagator(steps, 0.25, 2, LayerRNG(0, enabled=False), record=True)
    u = torch.randn(2, dtype=torch.float64)
    y = prop(0, 3, u, final=True)
    assert not y.requires_grad and torch.equal(y, steps[2](u, 0.25))
    assert prop.inputs[2].requires_grad and prop.outputs[2].grad_fn is not None
    assert prop(0, 3, u).grad_fn is None and len(prop.inputs) == 1
