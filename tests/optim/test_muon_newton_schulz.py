"""GefenMuon's Newton–Schulz iteration against torch's and an SVD reference, and the
learning-rate adjustment against torch.optim.Muon's."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _adjust_lr as torch_adjust_lr
from torch.optim._muon import _zeropower_via_newtonschulz as torch_zeropower

from leantrain.optim.muon import (
    adjust_lr,
    newton_schulz,
    newton_schulz_reference,
)
from tests._helpers.muon_models import rel as _rel

COEFFS = (3.4445, -4.775, 2.0315)
SHAPES = [(16, 24), (40, 12), (9, 9)]


# --- Newton–Schulz and the lr adjustment -------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_bf16_is_torch_muon_bit_for_bit(shape):
    G = torch.randn(shape)
    ours = newton_schulz(G, 5, COEFFS, 1e-7, dtype=torch.bfloat16)
    theirs = torch_zeropower(G, COEFFS, 5, 1e-7).float()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_newton_schulz_equals_polynomial_of_singular_values(shape, steps):
    G = torch.randn(shape, dtype=torch.float64)
    reference = newton_schulz_reference(G, steps, COEFFS, 1e-7)
    assert _rel(newton_schulz(G, steps, dtype=torch.float64), reference) < 1e-10
    assert _rel(newton_schulz(G.float(), steps, dtype=torch.float32), reference) < 1e-5
    assert _rel(newton_schulz(G.float(), steps), reference) < 3e-2  # bf16


def test_newton_schulz_orthogonalizes():
    # Keller Jordan's coefficients push every singular value into ~[0.68, 1.13].
    G = torch.randn(32, 64, dtype=torch.float64)
    s = torch.linalg.svdvals(newton_schulz(G, dtype=torch.float64))
    assert s.min() > 0.6 and s.max() < 1.2


def test_newton_schulz_zero_matrix_stays_zero():
    assert torch.equal(newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((torch.zeros(5),), ValueError, r"2-D matrix, got shape \(5,\)"),
        ((torch.zeros(2, 3, 4),), ValueError, r"got shape \(2, 3, 4\)"),
        ((torch.zeros(3, 3), 100), ValueError, "Invalid ns_steps: 100"),
        ((torch.zeros(3, 3), 2.5), TypeError, "ns_steps must be an int, got 2.5"),
        ((torch.zeros(3, 3), 5, (1.0, 2.0)), ValueError, "Invalid ns_coefficients"),
        ((torch.zeros(3, 3), 5, COEFFS, -1.0), ValueError, "Invalid epsilon value"),
    ],
)
def test_newton_schulz_rejects_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        newton_schulz(*args)


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (30, 30)])
def test_adjust_lr_matches_torch(fn, shape):
    assert adjust_lr(0.02, fn, torch.Size(shape)) == torch_adjust_lr(
        0.02, fn, torch.Size(shape)
    )


def test_adjust_lr_rejects_unknown_name():
    with pytest.raises(ValueError, match="Invalid adjust_lr_fn: 'sqrt'"):
        adjust_lr(0.1, "sqrt", torch.Size((3, 3)))
