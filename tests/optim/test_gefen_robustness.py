"""Gefen: checkpoints, non-finite gradients and unusual parameters (late, frozen,
empty, sparse, complex) and bad options."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from leantrain.optim import Gefen, optimizer_state_nbytes

# --- checkpoints ---------------------------------------------------------------------


def _trained(kit, steps=3, **kwargs):
    x, y = kit.make_data()
    model = kit.make_mlp()
    opt = Gefen(model.parameters(), lr=1e-2, **kwargs)
    kit.train(model, opt, x, y, steps)
    return model, opt


def test_checkpoint_keeps_one_shared_codebook_and_resumes(kit):
    x, y = kit.make_data()
    model, opt = _trained(kit)
    saved = opt.state_dict()
    # A consolidated checkpoint gathers each parameter's state on its own: the
    # codebook arrives as one copy per parameter. Gefen must re-share it.
    consolidated = {
        "param_groups": saved["param_groups"],
        "state": {
            i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()
        },
    }
    for checkpoint in (kit.roundtrip(saved), kit.roundtrip(consolidated)):
        resumed_model = kit.clone(model)
        resumed = Gefen(resumed_model.parameters(), lr=1e-2)
        resumed.load_state_dict(checkpoint)
        codebooks = {id(s["codebook"]) for s in resumed.state.values()}
        assert len(codebooks) == 1
        assert optimizer_state_nbytes(resumed) == optimizer_state_nbytes(opt)
        reference_model = kit.clone(model)
        reference = Gefen(reference_model.parameters(), lr=1e-2)
        reference.load_state_dict(kit.roundtrip(saved))
        kit.train(resumed_model, resumed, x, y, 3)
        kit.train(reference_model, reference, x, y, 3)
        assert kit.max_diff(resumed_model, reference_model) == 0.0


def test_resume_20_steps_equals_uninterrupted(kit):
    x, y = kit.make_data()
    model, opt = _trained(kit, steps=10, momentum_bits=4)
    resumed_model = kit.clone(model)
    resumed = Gefen(resumed_model.parameters(), lr=1e-2, momentum_bits=4)
    resumed.load_state_dict(kit.roundtrip(opt.state_dict()))
    kit.train(model, opt, x, y, 10)
    kit.train(resumed_model, resumed, x, y, 10)
    assert kit.max_diff(model, resumed_model) == 0.0
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(value, resumed.state[q][key]), key


def test_adamw_state_dict_is_rejected(kit):
    model = kit.make_mlp()
    adamw = torch.optim.AdamW(model.parameters())
    kit.train(model, adamw, *kit.make_data(), 1)
    opt = Gefen(model.parameters())
    with pytest.raises(ValueError, match="not a Gefen state dict"):
        opt.load_state_dict(adamw.state_dict())


def test_mismatched_gefen_checkpoints_are_rejected(kit):
    _, opt = _trained(kit)
    saved = opt.state_dict()
    other_model = kit.make_mlp((12, 40, 32, 5))  # same parameter count per group
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(40, 12\)\).*shape"):
        Gefen(other_model.parameters()).load_state_dict(saved)
    with pytest.raises(
        ValueError, match="momentum_bits=8, this optimizer momentum_bits=4"
    ):
        Gefen(kit.make_mlp().parameters(), momentum_bits=4).load_state_dict(saved)
    broken = kit.roundtrip(saved)
    del broken["state"][2]["exp_avg_sq"]
    fresh = Gefen(kit.make_mlp().parameters())
    with pytest.raises(
        ValueError, match=r"parameter 2 .*missing keys \['exp_avg_sq'\]"
    ):
        fresh.load_state_dict(broken)
    assert not fresh.state  # nothing was half-loaded
    wrong_codes = kit.roundtrip(saved)
    wrong_codes["state"][0]["exp_avg_codes"] = wrong_codes["state"][0]["exp_avg_codes"][
        :7
    ]
    with pytest.raises(ValueError, match="exp_avg_codes' has shape"):
        Gefen(kit.make_mlp().parameters()).load_state_dict(wrong_codes)


def test_named_parameters_name_the_offender(kit):
    model = kit.make_mlp()
    opt = Gefen(model.named_parameters(), lr=1e-2)
    model(torch.randn(4, 12)).sum().backward()
    model[3].weight.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="'3.weight'"):
        opt.step()


# --- non-finite gradients ----------------------------------------------------------


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return params, state


@pytest.mark.parametrize("bits", [8, 4])  # both factor matrices: factors kept too
def test_nonfinite_gradient_skips_the_whole_step(kit, bits):
    x, y = kit.make_data()
    model, opt = _trained(kit, momentum_bits=bits)
    assert "factored" in opt.state[model[0].weight]
    params, state = _snapshot(model, opt)
    for bad in (float("nan"), float("inf")):
        opt.zero_grad()
        kit.loss_fn(model, x, y).backward()
        model[3].bias.grad[1] = bad
        with pytest.warns(
            RuntimeWarning,
            match=r"non-finite gradient in parameter 5 \(shape \(32,\)\)",
        ):
            opt.step()
        assert all(
            torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)
        )
        for p, s in opt.state.items():
            assert all(torch.equal(v, state[p][k]) for k, v in s.items())
    assert opt.nonfinite_steps == 2
    kit.train(model, opt, x, y, 1)  # and training goes on
    assert not torch.equal(model[0].weight, params[0])
    assert float(opt.state[model[0].weight]["step"]) == 4


def test_finite_flags_match_isfinite_for_small_large_and_mixed_dtypes():
    """The batched check (one 2-norm per dtype, non-finite norms confirmed one by
    one) agrees with isfinite(g).all(), overflowing norms of finite values too."""
    from leantrain.optim._checks import finite_flags

    torch.manual_seed(0)
    sizes = [1, 7, 512, 65536, 65537, 200_000]
    grads, expected = [], []
    for k, n in enumerate(sizes * 3):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[k % 3]
        g = (torch.randn(n) * 1e3).to(dtype)
        bad = (None, float("nan"), float("inf"), float("-inf"))[k % 4]
        if bad is not None:
            g[(k * 7919) % n] = bad
        grads.append(g)
        expected.append(bool(torch.isfinite(g).all()))
    grads.append(torch.empty(0))
    expected.append(True)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        big = torch.full((5,), torch.finfo(dtype).max, dtype=dtype)  # norm overflows
        grads.append(big)
        expected.append(True)
    assert finite_flags(grads) == expected
    assert finite_flags([]) == []


def test_native_finite_check_covers_each_format_and_declines_others(monkeypatch):
    """The C pass reads fp32/bf16/fp16 exponent bits (NaN, +-inf anywhere, the
    last element too); other dtypes and strided tensors go back to torch."""
    from leantrain.optim import _native
    from leantrain.optim._checks import _native_all_finite, finite_flags

    if _native.load() is None:
        pytest.skip(f"native kernel unavailable: {_native.status()}")
    n = 70_001
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = torch.randn(n).to(dtype)
        assert _native_all_finite(g) is True
        for where in (0, n // 2, n - 1):
            for bad in (float("nan"), float("inf"), float("-inf")):
                h = g.clone()
                h[where] = bad
                assert _native_all_finite(h) is False
    big = torch.full((n,), torch.finfo(torch.float16).max, dtype=torch.float16)
    assert _native_all_finite(big) is True  # largest finite: exponent not all ones
    assert _native_all_finite(torch.randn(n, dtype=torch.float64)) is None
    assert _native_all_finite(torch.randn(n, 2)[:, 0]) is None  # not contiguous
    monkeypatch.setenv("LEANTRAIN_NO_NATIVE", "1")
    h = torch.randn(n)
    h[-1] = float("nan")
    assert _native_all_finite(h) is None and finite_flags([h]) == [False]


def test_nonfinite_first_step_creates_no_state(kit):
    model = kit.make_mlp()
    opt = Gefen(model.parameters())
    model(torch.randn(4, 12)).sum().backward()
    model[0].weight.grad[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert [w.category for w in caught] == [RuntimeWarning]
    assert not any(opt.state.values())


def test_nonfinite_raise(kit):
    model, opt = _trained(kit, nonfinite="raise")
    params, _ = _snapshot(model, opt)
    model[0].weight.grad[0, 0] = float("-inf")
    with pytest.raises(FloatingPointError, match=r"parameter 0 \(shape \(32, 12\)\)"):
        opt.step()
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True)
    )


# --- unusual parameters and bad input ----------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_empty_parameters_get_no_state(kit, bits):
    model = kit.make_mlp()
    empty_1d, empty_2d = nn.Parameter(torch.empty(0)), nn.Parameter(torch.empty(0, 5))
    opt = Gefen([*model.parameters(), empty_1d, empty_2d], lr=1e-2, momentum_bits=bits)
    for _ in range(2):
        opt.zero_grad()
        (
            kit.loss_fn(model, *kit.make_data()) + empty_1d.sum() + empty_2d.sum()
        ).backward()
        opt.step()
    assert empty_1d.grad is not None and not opt.state.get(empty_1d)
    assert not opt.state.get(empty_2d) and opt.state[model[0].weight]


def test_sparse_gradient_raises():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Gefen(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradients"):
        opt.step()


def test_complex_parameter_raises():
    with pytest.raises(TypeError, match="complex parameters"):
        Gefen([nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    opt = Gefen([nn.Parameter(torch.zeros(3))])
    with pytest.raises(TypeError, match="complex parameters"):
        opt.add_param_group(
            {"params": [nn.Parameter(torch.zeros(2, dtype=torch.cfloat))]}
        )
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"momentum_bits": 3}, "Invalid momentum_bits: 3"),
        ({"momentum_bits": True}, "Invalid momentum_bits: True"),
        ({"partition": "rows"}, "Invalid partition: 'rows'"),
        ({"partition": 0}, "Invalid partition block length: 0"),
        ({"partition": 2.5}, "Invalid partition: 2.5"),
        ({"nonfinite": "ignore"}, "Invalid nonfinite: 'ignore'"),
        ({"betas": (0.9,)}, "betas must be a pair"),
    ],
)
def test_invalid_gefen_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Gefen([nn.Parameter(torch.zeros(3))], **kwargs)
    opt = Gefen([nn.Parameter(torch.zeros(3))])
    if "nonfinite" not in kwargs:  # the others are per-group options too
        with pytest.raises(ValueError, match=message):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], **kwargs})
        assert len(opt.param_groups) == 1


def test_the_skip_warning_points_at_the_callers_line():
    model = torch.nn.Linear(4, 3)
    opt = Gefen(model.parameters())
    for step in range(2):  # a first step (state built after the check) and a later one
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        if step:
            model.weight.grad[0, 0] = float("nan")
        with pytest.warns(RuntimeWarning) if step else _no_warning() as caught:
            opt.step()
        if step:
            assert caught[0].filename == __file__
    model.weight.grad[0, 0] = float("nan")  # NaN on the very first step
    opt2 = Gefen(model.parameters())
    with pytest.warns(RuntimeWarning) as caught:
        opt2.step()
    assert caught[0].filename == __file__


class _no_warning:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")
        return []

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
