"""benchmarks/second_moment_probes.py against independent references."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from leantrain.optim import Gefen

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probes():
    path = ROOT / "benchmarks" / "second_moment_probes.py"
    spec = importlib.util.spec_from_file_location("bench_second_moment_probes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(model: torch.nn.Module, optimizer, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 12, generator=gen) * torch.linspace(0.01, 3.0, 12)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _mlp(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16, bias=bias),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3, bias=bias),
    )


def _assert_close(a: torch.nn.Module, b: torch.nn.Module, rtol: float) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=1e-7)


def test_own_second_moment_is_adamw(probes):
    model = _mlp(bias=True)
    reference = copy.deepcopy(model)
    _train(model, probes.ProbeAdamW(model.parameters(), 1e-2, "own"), 40)
    _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), 40)
    _assert_close(model, reference, rtol=1e-6)


def test_factored_is_gefens_factored_second_moment(probes):
    # fp32 momentum, no clip: Gefen's second_moment="factored" is Adafactor's factors in
    # AdamW's update, as the probe's; a bias-free model keeps the 1-D blocks out of it.
    model = _mlp(bias=False)
    reference = copy.deepcopy(model)
    _train(model, probes.ProbeAdamW(model.parameters(), 1e-2, "factored"), 40)
    gefen = Gefen(
        reference.parameters(),
        lr=1e-2,
        momentum_bits=None,
        second_moment="factored",
        update_clip=None,
    )
    _train(reference, gefen, 40)
    _assert_close(model, reference, rtol=1e-5)


def test_sm3_cover_bounds_every_elements_own_second_moment(probes):
    model = _mlp(bias=False)
    optimizer = probes.ProbeAdamW(model.parameters(), 1e-2, "sm3")
    own = {p: torch.zeros_like(p) for p in model.parameters()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        x = torch.randn(32, 12, generator=gen) * torch.linspace(0.01, 3.0, 12)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        for p in model.parameters():
            own[p].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
        optimizer.step()
        for p in model.parameters():
            rows, cols = optimizer.state[p]["rows"], optimizer.state[p]["cols"]
            cover = torch.minimum(rows[:, None], cols[None, :])
            assert bool((cover >= own[p] * (1 - 1e-5)).all())


def test_stochastic_codes_are_unbiased_and_nearest_is_nearest(probes):
    codebook = torch.tensor([-1.0, -0.25, 0.0, 0.1, 1.0])
    x = torch.full((200_000,), 0.04)
    gen = torch.Generator().manual_seed(0)
    codes = probes.round_to_codes(x, codebook, "stochastic", gen)
    assert set(codes.unique().tolist()) == {2, 3}  # the two neighbours, 0 and 0.1
    stored = codebook[codes]
    assert float(stored.mean()) == pytest.approx(0.04, abs=1e-3)
    near = probes.round_to_codes(
        torch.tensor([0.04, 0.06, -0.2, 0.9]), codebook, "nearest", gen
    )
    assert near.tolist() == [2, 3, 1, 4]


def test_nearest_codes_keep_small_momenta_that_stochastic_codes_let_decay(probes):
    # The dead band of docs/gefen.md: with a zero gradient, 0.9 c rounds back to c for
    # codes near 0; unbiased codes decay to exactly 0.
    momenta = {}
    for rounding in ("nearest", "stochastic"):
        p = torch.nn.Parameter(torch.zeros(256))
        optimizer = probes.ProbeAdamW([p], 1e-3, f"own:q8:{rounding}")
        first = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 0.01
        first[0] = 1.0
        for t in range(200):
            p.grad = first.clone() if t == 0 else torch.zeros(256)
            p.grad[0] = 1.0
            optimizer.step()
        momenta[rounding] = optimizer._dequantize(optimizer.state[p])[1:]
    assert int((momenta["nearest"] != 0).sum()) > 100
    assert int((momenta["stochastic"] != 0).sum()) == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("adafactor", "unknown second moment 'adafactor'"),
        ("factored:clip0", "'clip0'"),
        ("factored:banana", "'banana'"),
        ("own:q9", "2 <= B <= 8"),
        ("sm3:xfast", "'xfast'"),
    ],
)
def test_bad_probe_specs_are_refused(probes, spec, message):
    with pytest.raises(ValueError, match=message):
        probes.parse_probe(spec)
