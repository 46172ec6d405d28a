"""A non-finite loss or gradient leaves the maker's state intact: the step is skipped
(``.grad`` cleared, so the optimizer changes nothing) with a warning each time, or
raises under ``nonfinite="raise"``; under a GradScaler only the curvature is
discarded and the scaler skips the step."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leantrain.precond import PreconditioningConfig
from leantrain.precond.registry import make_gradient_maker


def model() -> nn.Module:
    torch.manual_seed(0)
    # 24 wide at batch 8: K-FAC skips the middle weight gradient (factored path).
    return nn.Sequential(
        nn.Linear(5, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3)
    )


def batches():
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(3)
    ]


def step(gm, net, x, t):
    for p in net.parameters():
        p.grad = None
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(net, x), t)
    gm.forward_and_backward()
    return [p.grad for p in net.parameters()]


def tensors(state):
    """Every tensor of a (nested) state dict, in key order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in tensors(state[k])]
    return []


@pytest.mark.parametrize("method", ["kfac_1", "kfac", "shampoo", "ng_diag", "seng"])
def test_nonfinite_curvature_pass_is_discarded(method):
    (x0, t0), (x1, t1), (x2, t2) = batches()
    net = model()
    gm = make_gradient_maker(method, net)
    if gm.config.curvature_interval > 1:  # every step is a curvature step here
        gm.config = PreconditioningConfig(damping=gm.config.damping, ema_decay=0.9)
    ref_net = copy.deepcopy(net)
    ref = make_gradient_maker(method, ref_net)
    ref.config = gm.config
    step(gm, net, x0, t0)
    step(ref, ref_net, x0, t0)
    before = copy.deepcopy(gm.state_dict())

    bad = x1.clone()
    bad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite gradient at step 1: the st"):
        grads = step(gm, net, bad, t1)
    assert all(g is None for g in grads)  # optimizer.step() leaves them alone
    assert gm.skipped_curvature_updates == 1 and gm.nonfinite_steps == 1
    assert gm.step == before["step"]  # the skipped step is not counted
    after = gm.state_dict()
    assert after["curvature_updates"] == before["curvature_updates"]
    assert after["preconditioner_updates"] == before["preconditioner_updates"]
    for a, b in zip(tensors(before), tensors(after), strict=True):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    # The next finite step continues from the state of the last finite one: as if
    # the bad step never happened (the step counter aside, which both share here).
    ref.step = gm.step
    if hasattr(gm, "generators"):  # the bad pass drew its Monte-Carlo samples too
        ref.generators.set_state(gm.generators.get_state())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        got = step(gm, net, x2, t2)
    want = step(ref, ref_net, x2, t2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_all_finite_sees_nan_and_inf_and_not_a_large_half_sum():
    from leantrain.precond.preconditioned import all_finite

    ok = [torch.randn(50, 40), torch.randn(7, dtype=torch.float64)]
    assert all_finite(ok) and all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(50, 40)
        t[3, 4] = bad
        assert not all_finite([*ok, t])
    # 70,000 ones sum past float16's 65,504: summed in float32, still finite.
    assert all_finite([torch.ones(70_000, dtype=torch.float16)])
    assert all_finite([torch.ones(70_000, dtype=torch.bfloat16)])


@pytest.mark.parametrize("method", ["kfac", "seng", "shampoo", "hessian_free"])
def test_empty_batch_on_a_curvature_step(method):
    # Makers whose curvature comes from module hooks refuse it by name (their
    # factors divide by the example count), the others see the mean loss of no
    # examples, NaN, and discard the pass; neither changes the state.
    net = model()
    gm = make_gradient_maker(method, net)
    x, t = torch.randn(0, 5), torch.zeros(0, dtype=torch.long)
    before = copy.deepcopy(gm.state_dict())
    gm.setup_loss_call(F.cross_entropy, gm.setup_model_call(net, x), t)
    if method in ("kfac", "seng"):
        with pytest.raises(ValueError, match="module '0': the batch is empty"):
            gm.forward_and_backward()
        assert gm.step == 0
    else:
        with pytest.warns(RuntimeWarning, match="non-finite"):
            gm.forward_and_backward()
        assert gm.skipped_curvature_updates == 1
    after = gm.state_dict()
    assert after["curvature_updates"] == before["curvature_updates"] == 0
    for a, b in zip(tensors(before), tensors(after), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", ["maker", "in_loop"])
@pytest.mark.parametrize("method", ["kfac", "shampoo"])
def test_a_diverging_run_never_makes_a_parameter_nan_silently(form, method):
    # Squared error on a ReLU net with SGD at lr 1 diverges: the loss overflows to
    # inf, then NaN, within 30 steps (cross-entropy's gradient stays bounded).
    from leantrain.precond import precondition_in_loop

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(5, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3)
    )
    sgd = torch.optim.SGD(net.parameters(), lr=1.0, momentum=0.9)
    # The registry's safeguards (KL clip, grafting) off: this run must diverge.
    config = {"damping": 1e-8, "kl_clip": None, "grafting": None}
    kwargs = {"loss_type": "mse"} if method == "kfac" else {}
    if form == "maker":
        gm = make_gradient_maker(method, net, config=config, **kwargs)
    else:
        opt = precondition_in_loop(sgd, net, method, config=config, **kwargs)
        gm = opt.maker
    losses = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(30):
            x, t = torch.randn(8, 5), torch.randn(8, 3)
            if form == "maker":
                for p in net.parameters():
                    p.grad = None
                gm.setup_loss_call(F.mse_loss, gm.setup_model_call(net, x), t)
                losses.append(float(gm.forward_and_backward()[1]))
                sgd.step()
            else:
                loss = F.mse_loss(net(x), t)
                loss.backward()
                losses.append(float(loss))
                opt.step()
                opt.zero_grad()
            assert all(torch.isfinite(p).all() for p in net.parameters())
    assert not all(math.isfinite(v) for v in losses)  # it did diverge
    skipped = [w for w in record if "the step is skipped" in str(w.message)]
    assert gm.nonfinite_steps > 0 and len(skipped) == gm.nonfinite_steps  # each time


@pytest.mark.parametrize("form", ["maker", "in_loop"])
def test_nonfinite_raise_raises_and_changes_nothing(form):
    from leantrain.precond import precondition_in_loop

    net = model()
    before = copy.deepcopy(net.state_dict())
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    config = {"nonfinite": "raise"}
    (x, t), _, _ = batches()
    x = x.clone()
    x[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite gradient at step 0"):
        if form == "maker":
            step(make_gradient_maker("kfac", net, config=config), net, x, t)
        else:
            opt = precondition_in_loop(sgd, net, "kfac", config=config)
            F.cross_entropy(net(x), t).backward()
            opt.step()
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_nonfinite_option_is_validated():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        PreconditioningConfig(nonfinite="ignore")
    with pytest.raises(ValueError, match="grafting must be one of"):
        PreconditioningConfig(grafting="adam")
