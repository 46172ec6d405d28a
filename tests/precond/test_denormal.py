"""Subnormal flushing around the preconditioner's arithmetic: on inside, the user's
mode restored after, and the model's own passes untouched."""

import pytest
import torch
import torch.nn.functional as F

from leantrain.precond import PreconditioningConfig
from leantrain.precond._denormal import denormals_flushed, flushing_denormals
from leantrain.precond.methods.kfac import KfacGradientMaker

SUBNORMAL = 2.0**-140  # float32 subnormal (smallest normal: 2^-126)

pytestmark = pytest.mark.skipif(
    not torch.set_flush_denormal(False), reason="this CPU cannot flush subnormals"
)


def _product_is_zero() -> bool:
    return (torch.tensor(SUBNORMAL) * torch.tensor(1.0)).item() == 0.0


@pytest.mark.parametrize("user_mode", [False, True])
def test_flushes_inside_and_restores_the_users_mode(user_mode):
    torch.set_flush_denormal(user_mode)
    try:
        assert flushing_denormals() is user_mode
        assert _product_is_zero() is user_mode
        with denormals_flushed():
            assert flushing_denormals()
            assert _product_is_zero()
        assert flushing_denormals() is user_mode
        with pytest.raises(RuntimeError), denormals_flushed():
            raise RuntimeError("inside")
        assert flushing_denormals() is user_mode
    finally:
        torch.set_flush_denormal(False)


def test_kfac_step_leaves_the_mode_and_flushes_only_its_own_arithmetic():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh())
    seen = []

    def record(module, args, output):  # the model's forward: user's mode
        seen.append(flushing_denormals())

    model.register_forward_hook(record)
    gm = KfacGradientMaker(model, PreconditioningConfig(damping=1e-2))
    applied = []
    original = gm.precondition

    def precondition():
        applied.append(flushing_denormals())
        original()

    gm.precondition = precondition
    for _ in range(2):
        out = gm.setup_model_call(model, torch.randn(8, 4))
        gm.setup_loss_call(F.mse_loss, out, torch.randn(8, 6))
        gm.forward_and_backward()
    assert seen and not any(seen)
    assert applied == [True, True]
    assert not flushing_denormals()
