"""FisherOptions: the six Fisher options stated once, the keyword form folded in."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from leantrain.precond import (
    EkfacGradientMaker,
    FisherOptions,
    KfacGradientMaker,
    NaturalGradientMaker,
    SengGradientMaker,
    SmwNgGradientMaker,
)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    ).double()


def _step(gm, model):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    t = torch.randint(0, 3, (8,), generator=g)
    y = gm.setup_model_call(model, x)
    gm.setup_loss_call(F.cross_entropy, y, t)
    gm.forward_and_backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "cls", [KfacGradientMaker, EkfacGradientMaker, NaturalGradientMaker]
)
def test_fisher_options_equal_the_keyword_form(cls):
    options = FisherOptions("fisher_mc", n_mc_samples=2, seed=5)
    a, b = _model(), _model()
    got = _step(cls(a, fisher=options), a)
    want = _step(cls(b, fisher_type="fisher_mc", n_mc_samples=2, seed=5), b)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_keywords_override_the_options_and_defaults_hold():
    gm = KfacGradientMaker(
        _model(), fisher=FisherOptions(seed=3), fisher_type="fisher_emp"
    )
    assert gm.fisher_options == FisherOptions("fisher_emp", seed=3)
    assert gm.fisher_type == "fisher_emp" and gm.n_mc_samples == 1
    assert KfacGradientMaker(_model()).fisher_options == FisherOptions()


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [
        ({"fisher_type": "fisher_x"}, ValueError),
        ({"n_mc_samples": 0}, ValueError),
        ({"n_mc_samples": True}, TypeError),
        ({"loss_type": "hinge"}, ValueError),
        ({"logits_fn": 3}, TypeError),
        ({"seed": 1.5}, TypeError),
    ],
)
def test_bad_options_raise(kwargs, err):
    with pytest.raises(err):
        FisherOptions(**kwargs)
    with pytest.raises(err):
        KfacGradientMaker(_model(), **kwargs)


def test_unknown_keyword_and_wrong_type_raise():
    with pytest.raises(TypeError, match="unexpected keyword argument 'fisher_kind'"):
        KfacGradientMaker(_model(), fisher_kind="fisher_emp")
    with pytest.raises(TypeError, match="fisher must be a FisherOptions"):
        KfacGradientMaker(_model(), fisher={"fisher_type": "fisher_emp"})


@pytest.mark.parametrize("cls", [SmwNgGradientMaker, SengGradientMaker])
def test_empirical_methods_fix_the_fisher_type(cls):
    config = None
    gm = cls(_model(), config, fisher=FisherOptions("fisher_emp", seed=2))
    assert gm.fisher_type == "fisher_emp" and gm.fisher_options.seed == 2
    with pytest.raises(ValueError, match="fisher_type='fisher_emp'"):
        cls(_model(), fisher=FisherOptions("fisher_mc"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'fisher_type'"):
        cls(_model(), fisher_type="fisher_emp")
    copy.deepcopy(gm)  # the options are plain data
