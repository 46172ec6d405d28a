"""robust_eigh, cholesky_inverse, cholesky_ex, damped_cholesky, pi_damping."""

from __future__ import annotations

import pytest
import torch

from leantrain.precond.curv import (
    cholesky_ex,
    cholesky_inverse,
    damped_cholesky,
    pi_damping,
    robust_eigh,
)


def _spd(n, batch=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, 2 * n, generator=g, dtype=torch.float64)
    return x @ x.transpose(-1, -2) / (2 * n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_robust_eigh_reconstructs(dtype):
    m = _spd(6, (3,)).to(dtype)
    vals, vecs = robust_eigh(m)
    assert vals.dtype == dtype and vecs.dtype == dtype
    rebuilt = vecs @ torch.diag_embed(vals) @ vecs.transpose(-1, -2)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(rebuilt, m, atol=tol)
    assert torch.all(vals[..., 1:] >= vals[..., :-1])


@pytest.mark.parametrize("damping", [0.0, 0.1])
def test_cholesky_inverse_matches_solve(damping):
    m = _spd(5, (4,), seed=1)
    got = cholesky_inverse(m, damping)
    eye = torch.eye(5, dtype=torch.float64)
    expected = torch.linalg.solve(m + damping * eye, eye.expand(4, 5, 5))
    assert torch.allclose(got, expected, rtol=1e-9, atol=1e-10)


def test_cholesky_inverse_retries_in_float64():
    eps = 1e-10  # PD in float64, singular once rounded to float32
    m = torch.tensor([[1.0, 1.0 - eps], [1.0 - eps, 1.0]], dtype=torch.float64)
    got = cholesky_inverse(m, compute_dtype=torch.float32)
    assert torch.allclose(got @ m, torch.eye(2, dtype=torch.float64), atol=1e-5)
    with pytest.raises(torch.linalg.LinAlgError, match="increase the damping"):
        cholesky_inverse(-torch.eye(2))


def test_bad_inputs():
    with pytest.raises(ValueError, match="damping must be finite and >= 0, got -1"):
        cholesky_inverse(torch.eye(2), -1.0)
    with pytest.raises(ValueError, match=r"square matrix, got shape \(2, 3\)"):
        robust_eigh(torch.zeros(2, 3))
    with pytest.raises(TypeError, match="floating tensor"):
        robust_eigh(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="compute_dtype"):
        robust_eigh(torch.eye(2), compute_dtype=torch.float16)


def test_pi_damping_balances_the_factors():
    a, b = _spd(4, seed=2), _spd(3, seed=3) * 10
    da, db = pi_damping(a, b, 0.04)
    assert da * db == pytest.approx(0.04)
    # equal relative damping: (da / mean eig A) == (db / mean eig B)
    assert da / (a.trace() / 4) == pytest.approx(float(db / (b.trace() / 3)))


def test_robust_eigh_retries_in_float64(monkeypatch):
    real = torch.linalg.eigh
    seen = []

    def flaky(m):  # LAPACK failing to converge in float32, as it does on bad factors
        seen.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("failed to converge")
        return real(m)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    m = _spd(4).float()
    vals, vecs = robust_eigh(m)
    assert seen == [torch.float32, torch.float64]
    assert vals.dtype == torch.float32
    assert torch.allclose(vecs @ torch.diag(vals) @ vecs.T, m, atol=1e-5)


@pytest.mark.parametrize("n", [127, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_ex_is_torchs_factor(n, dtype):
    """Padded (multiples of 128) or not, the factor reconstructs M as torch's does,
    is lower triangular, for a batch too."""
    m = _spd(n, (2,), seed=n).to(dtype)
    factor, info = cholesky_ex(m)
    ref, ref_info = torch.linalg.cholesky_ex(m)
    assert factor.shape == m.shape
    assert torch.equal(info, ref_info) and not bool(info.any())
    assert torch.equal(factor, factor.tril())
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(factor, ref, rtol=0, atol=tol)
    rebuilt = factor @ factor.transpose(-1, -2)
    torch.testing.assert_close(rebuilt, m, rtol=0, atol=tol)


def test_cholesky_ex_reports_the_failing_minor_like_torch():
    m = _spd(128, seed=3)
    m[5, 5] = -1.0  # the 6th leading minor is not positive
    assert int(cholesky_ex(m)[1]) == int(torch.linalg.cholesky_ex(m)[1]) == 6


def test_damped_cholesky_retries_in_float64_and_keeps_the_dtype():
    """fp32 absorbs the damping into the diagonal of a singular PSD matrix (1 + 1e-9
    rounds to 1), so its Cholesky fails; float64 keeps it and succeeds."""
    m = torch.ones(2, 2)
    damping = 1e-9
    assert bool(torch.linalg.cholesky_ex(m + damping * torch.eye(2))[1])  # fp32 fails
    factor = damped_cholesky(m, damping)
    assert factor.dtype == torch.float32
    expected = torch.linalg.cholesky(m.double() + damping * torch.eye(2).double())
    torch.testing.assert_close(factor, expected.float())
    with pytest.raises(torch.linalg.LinAlgError, match="not positive definite"):
        damped_cholesky(-torch.eye(3), 1e-3)
