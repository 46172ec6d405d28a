"""SOAP against a dense float64 reference of the paper's algorithm written here."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig, precondition_in_loop
from leantrain.precond.methods.soap import SoapGradientMaker, eigenbasis, refresh_basis

BETAS, SHAMPOO_BETA, EPS, FREQ = (0.9, 0.99), 0.8, 1e-8, 3


def eye(n):
    return torch.eye(n, dtype=torch.float64)


def descending_eigh(s):
    vals, vecs = torch.linalg.eigh(s)
    return vecs.flip(-1)


def soap_reference(grads, *, cap=10000):
    """SOAP (arXiv 2409.11321, Algorithm 3, as nikhilvyas/SOAP runs it) for one
    Linear layer: the direction of each step, for the weight and the bias.

    Factors are SOAP's lerp from zero, without bias correction (the maker corrects
    it: the bases do not depend on the scale). The first step builds the bases by
    eigh and moves nothing; a refresh (every FREQ Adam steps) sorts the columns by
    Rayleigh quotient and takes one power iteration + QR, after the Adam update.
    """
    b1, b2 = BETAS
    out, t = [], 0
    for k, (G, g) in enumerate(grads):
        sides = [G.shape[0] <= cap, G.shape[1] <= cap]
        outers = [G @ G.T, G.T @ G]
        if k == 0:
            stats = [
                (1 - SHAMPOO_BETA) * o if s else None
                for o, s in zip(outers, sides, strict=True)
            ]
            Q = [None if s is None else descending_eigh(s) for s in stats]
            m, v = torch.zeros_like(G), torch.zeros_like(G)
            mb, vb = torch.zeros_like(g), torch.zeros_like(g)
            out.append((torch.zeros_like(G), torch.zeros_like(g)))
            continue
        ql = eye(G.shape[0]) if Q[0] is None else Q[0]
        qr = eye(G.shape[1]) if Q[1] is None else Q[1]
        Gr = ql.T @ G @ qr
        t += 1
        m = b1 * m + (1 - b1) * Gr
        v = b2 * v + (1 - b2) * Gr**2
        mb = b1 * mb + (1 - b1) * g
        vb = b2 * vb + (1 - b2) * g**2
        correction = (1 - b2**t) ** 0.5 / (1 - b1**t)
        D = ql @ (m / (v.sqrt() + EPS)) @ qr.T * correction
        out.append((D, mb / (vb.sqrt() + EPS) * correction))
        m = ql @ m @ qr.T  # back to the original space
        stats = [
            None if s is None else SHAMPOO_BETA * s + (1 - SHAMPOO_BETA) * o
            for s, o in zip(stats, outers, strict=True)
        ]
        if t % FREQ == 0:
            for i, (s, q) in enumerate(zip(stats, Q, strict=True)):
                if s is None:
                    continue
                order = torch.argsort(torch.diag(q.T @ s @ q), descending=True)
                Q[i] = torch.linalg.qr(s @ q[:, order]).Q
                v = v[order] if i == 0 else v[:, order]
        ql = eye(G.shape[0]) if Q[0] is None else Q[0]
        qr = eye(G.shape[1]) if Q[1] is None else Q[1]
        m = ql.T @ m @ qr
    return out


def linear_loss(y, c):
    return (y * c).sum()  # with x = I: dW = c^T, db = c.sum(0)


def gradient_stream(n, rows=4, cols=5, seed=0, spectrum=None, noise=1e-3):
    """Loss weights whose gradients are generic, or (``spectrum``) near a fixed
    ``U diag(spectrum) V^T`` with well-separated singular values."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if spectrum is None:
        return [randn(cols, rows) for _ in range(n)]
    u, v = torch.linalg.qr(randn(rows, rows)).Q, torch.linalg.qr(randn(cols, cols)).Q
    base = u @ torch.diag(spectrum) @ v[:rows]
    return [(base + noise * randn(rows, cols)).T for _ in range(n)]


def soap_config(**overrides):
    fields = (
        dict(preconditioner_interval=FREQ, ema_decay=SHAMPOO_BETA, damping=EPS)
        | overrides
    )
    return PreconditioningConfig(**fields)


def maker_directions(stream, *, cap=10000, cls=SoapGradientMaker):
    torch.manual_seed(0)
    rows, cols = stream[0].shape[1], stream[0].shape[0]
    model = nn.Linear(cols, rows).double()
    gm = cls(model, soap_config(), betas=BETAS, max_precond_dim=cap)
    x = torch.eye(cols, dtype=torch.float64)
    out = []
    for c in stream:
        model.zero_grad()
        gm.setup_loss_call(linear_loss, gm.setup_model_call(model, x), c)
        gm.forward_and_backward()
        out.append((model.weight.grad.clone(), model.bias.grad.clone()))
    return out, gm


@pytest.mark.parametrize("cap", [10000, 4, 3])  # two-sided, one-sided, plain Adam
def test_matches_the_dense_reference(cap):
    # 8 steps: eigh at step 0, power iteration + QR after Adam steps 3 and 6.
    stream = gradient_stream(8)
    got, gm = maker_directions(stream, cap=cap)
    want = soap_reference([(c.T, c.sum(0)) for c in stream], cap=cap)
    for step, ((w, b), (rw, rb)) in enumerate(zip(got, want, strict=True)):
        for a, r in ((w, rw), (b, rb)):
            err = float((a - r).abs().max())
            assert err <= 1e-10 * float(r.abs().max()) + 1e-300, (step, err)
    assert all(float(d.abs().max()) > 0.1 for d, _ in got[1:])  # not a trivial zero
    sides = [None if q is None else tuple(q.shape) for q in gm.bases.get("weight", [])]
    assert sides == {10000: [(4, 4), (5, 5)], 4: [(4, 4), None], 3: []}[cap]
    assert gm.preconditioner_updates == 3 and int(gm.adam_steps["weight"]) == 7


def test_power_iteration_refresh_tracks_eigh():
    # A well-separated spectrum (ratios 2) and the basis of a perturbed matrix, its
    # columns shuffled: a refresh sorts them back and halves their error (the
    # eigenvalue ratio), repeated refreshes converge to eigh's basis.
    gen = torch.Generator().manual_seed(3)
    n = 6
    u = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64)).Q
    s = u @ torch.diag(2.0 ** -torch.arange(n, dtype=torch.float64)) @ u.T
    noise = torch.randn(n, n, generator=gen, dtype=torch.float64) * 1e-3
    previous = eigenbasis(s + noise + noise.T)[:, torch.randperm(n, generator=gen)]
    exact = eigenbasis(s)

    def error(q):  # |Q^T Q_eigh| against the identity
        return float(((q.T @ exact).abs() - eye(n)).abs().max())

    new, order = refresh_basis(s, previous)
    assert error(new) < 0.55 * error(previous[:, order])
    assert torch.allclose(new.T @ new, eye(n), atol=1e-12)
    for _ in range(20):
        new, order = refresh_basis(s, new)
        assert torch.equal(order, torch.arange(n))  # sorted once, sorted after
    assert error(new) < 1e-6


class EighRefreshSoap(SoapGradientMaker):
    """SOAP whose refreshes are full eigh decompositions (what the QR replaces)."""

    def update_preconditioner(self):
        super().update_preconditioner()
        for name, sides in self._refreshed.items():
            self._refreshed[name] = [
                None if side is None else (eigenbasis(s), side[1])
                for s, side in zip(self.factors[name], sides, strict=True)
            ]


def test_qr_refresh_gives_the_directions_of_eigh_refresh():
    # Gradients near a fixed U diag(s) V^T (noise 1e-2): the factors' eigenvectors
    # are well separated. After each refresh the QR bases are eigh's within 1e-2,
    # and the direction's components on the singular pairs (where the signal is)
    # agree within 1e-3. The other entries of the rotated gradient are noise-sized,
    # Adam turns them into steps of size ~1 and any basis difference of the noise's
    # size flips them: the whole directions differ by 5-25% here, at noise 1e-3 to
    # 0.3 alike.
    spectrum = torch.tensor([4.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    stream = gradient_stream(12, spectrum=spectrum, noise=1e-2)
    qr_run, eigh_run = [], []
    for cls, steps in ((SoapGradientMaker, qr_run), (EighRefreshSoap, eigh_run)):
        for k in range(4, 13, FREQ):  # just after the refreshes at 3, 6, 9
            directions, gm = maker_directions(stream[:k], cls=cls)
            steps.append((directions[-1][0], gm.bases["weight"]))
    for (a, qa), (b, qb) in zip(qr_run, eigh_run, strict=True):
        for x, y in zip(qa, qb, strict=True):
            assert float(((x.T @ y).abs() - eye(len(x))).abs().max()) < 1e-2
        left, right = qb
        signal = [torch.diagonal(left.T @ d @ right).abs() for d in (a, b)]
        assert float((signal[0] - signal[1]).abs().max()) < 1e-3


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def data(n, seed=1, batch=32):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    out = []
    for _ in range(n):
        x = torch.randn(batch, 5, generator=gen, dtype=torch.float64)
        out.append((x, (x @ w).argmax(1)))
    return out


def train(gm, model, batches, lr=3e-3):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    seen, losses = [], []
    for x, t in batches:
        opt.zero_grad()
        gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x), t)
        _, loss = gm.forward_and_backward()
        seen.append([p.grad.clone() for p in model.parameters()])
        losses.append(float(loss.detach()))
        opt.step()
    return seen, losses


def test_state_dict_round_trip_resumes_exactly():
    batches = data(8)
    reference = mlp()
    full, _ = train(SoapGradientMaker(reference, soap_config()), reference, batches)
    model = mlp()
    gm = SoapGradientMaker(model, soap_config())
    train(gm, model, batches[:4])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "gm": gm.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = mlp(seed=5)
    resumed.load_state_dict(saved["model"])
    gm2 = SoapGradientMaker(resumed, soap_config())
    gm2.load_state_dict(saved["gm"])
    got, _ = train(gm2, resumed, batches[4:])  # a refresh at step 6
    for g_step, w_step in zip(got, full[4:], strict=True):
        for a, b in zip(g_step, w_step, strict=True):
            assert torch.equal(a, b)
    bad = copy.deepcopy(saved["gm"])
    bad["extra"]["exp_avg"]["0.weight"] = torch.zeros(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'0.weight'\] has shape \(8, 4\)"):
        gm2.load_state_dict(bad)
    bad = copy.deepcopy(saved["gm"])
    wide = SoapGradientMaker(mlp(), soap_config(), max_precond_dim=4)
    bad["extra"]["factors"] = {}
    with pytest.raises(ValueError, match="side 'L' of '0.weight' is not rotated"):
        wide.load_state_dict(bad)


def test_in_loop_equals_the_maker():
    batches = data(7)
    reference = mlp()
    want, _ = train(SoapGradientMaker(reference, soap_config()), reference, batches)
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=3e-3)
    config = {"preconditioner_interval": FREQ, "ema_decay": SHAMPOO_BETA}
    opt = precondition_in_loop(sgd, model, "soap", config=config)
    assert opt.maker.config == soap_config() and opt.maker.betas == (0.95, 0.95)
    for (x, t), w_step in zip(batches, want, strict=True):
        opt.zero_grad()
        F.cross_entropy(model(x), t).backward()
        opt.step()
        for p, w in zip(model.parameters(), w_step, strict=True):
            torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-15)


def test_a_nonfinite_gradient_leaves_the_moments_as_they_were():
    # Curvature every 2nd step: the NaN arrives on a step without a curvature
    # check, so SOAP's own device-side flag must keep m, v and Adam's count.
    config = soap_config(curvature_interval=2, preconditioner_interval=2)
    batches = data(5)
    reference = mlp()
    gm = SoapGradientMaker(reference, config)
    want, _ = train(gm, reference, batches[:3] + batches[4:])
    model = mlp()
    gm = SoapGradientMaker(model, config)
    got, _ = train(gm, model, batches[:3])
    before = {n: (gm.exp_avg[n].clone(), gm.adam_steps[n].clone()) for n in gm.exp_avg}
    x, t = batches[3]
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(model, x * torch.nan), t)
    with pytest.warns(RuntimeWarning, match="non-finite gradient at step 3"):
        gm.forward_and_backward()
    for n, (m_, t_) in before.items():
        assert torch.equal(gm.exp_avg[n], m_) and torch.equal(gm.adam_steps[n], t_)
    got += train(gm, model, batches[4:])[0]
    for g_step, w_step in zip(got, want, strict=True):
        for a, b in zip(g_step, w_step, strict=True):
            assert torch.equal(a, b)


def test_bfloat16_parameters_run_in_float32():
    # The same (bf16-representable) gradients through a bf16 and a float32 model:
    # SOAP's state and arithmetic are float32 for both, so only the last rounding
    # of .grad to bf16 differs. (From the bf16 model's own backward the two differ
    # by 15-85%: Adam's near-sign first steps flip on the rounding of small rotated
    # entries; tests/precond/test_registry.py.)
    stream = [c.to(torch.bfloat16).double() for c in gradient_stream(6)]
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        model = nn.Linear(5, 4).to(dtype)
        opt = precondition_in_loop(
            torch.optim.SGD(model.parameters(), lr=0.0), model, "soap"
        )
        for c in stream:
            model.weight.grad = c.T.to(dtype)
            model.bias.grad = c.sum(0).to(dtype)
            opt.step()
        assert model.weight.grad.dtype == dtype
        assert opt.maker.exp_avg["weight"].dtype == torch.float32
        outs.append(model.weight.grad.float())
    assert float((outs[1] - outs[0]).norm() / outs[0].norm()) < 1e-2


def test_training_lowers_the_loss():
    model = mlp(dtype=torch.float32)
    gm = SoapGradientMaker(model, soap_config(preconditioner_interval=10))
    batches = [(x.float(), t) for x, t in data(60)]
    _, losses = train(gm, model, batches, lr=3e-2)
    assert losses[-1] < 0.4 * losses[0]


def test_bad_arguments_raise():
    model = mlp()
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0: 1.0"):
        SoapGradientMaker(model, betas=(1.0, 0.9))
    with pytest.raises(TypeError, match="betas must be a pair"):
        SoapGradientMaker(model, betas=0.9)
    with pytest.raises(ValueError, match="max_precond_dim must be an int >= 1, got 0"):
        SoapGradientMaker(model, max_precond_dim=0)


def test_sgd_momentum_around_soap_is_named():
    # SOAP's direction holds Adam's momentum and scale: SGD's momentum on top is
    # what made it diverge at SGD(0.05, momentum=0.9); without momentum it is SOAP.
    import warnings

    model = nn.Linear(4, 3)
    with pytest.warns(UserWarning, match="SOAP wraps SGD with momentum=0.9"):
        precondition_in_loop(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, "soap"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
        precondition_in_loop(sgd, model, "soap")
        precondition_in_loop(torch.optim.AdamW(model.parameters()), model, "soap")
