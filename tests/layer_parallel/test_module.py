"""LayerParallel on the reference models: exact against the models' own serial
ResidualStack (output, input gradient, every parameter gradient), accumulation,
serial/parallel switching, dropout determinism, convergence and divergence reports."""

from __future__ import annotations

import copy
import doctest
import re
import warnings

import pytest
import torch
from torch import nn

import leantrain.layer_parallel as lp_pkg
from leantrain.layer_parallel import LayerParallel, MGRITDivergenceError
from leantrain.layer_parallel.costs import skipped_cycle_work, vcycle_work
from leantrain.layer_parallel.mgrit import CONVERGENCE_RTOL
from leantrain.models import (
    BERT,
    GPT,
    BERTConfig,
    EncDecConfig,
    EncoderDecoder,
    GPTConfig,
    ResidualStack,
    TransformerBlock,
    ViT,
    ViTConfig,
)

D = 16


def _model(kind: str, n: int, seed: int = 0, dropout: float = 0.0):
    """A float64 model with ``n`` ODE steps (h = 1/n) and one batch of inputs."""
    torch.manual_seed(seed)
    kw = dict(n_head=2, d_model=D, t_final=1.0, dropout=dropout)
    if kind == "gpt":
        m = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=n, **kw))
        inputs = (torch.randint(0, 11, (2, 6)),)
    elif kind == "bert":
        cfg = BERTConfig(vocab_size=12, mask_token_id=11, block_size=8, n_layer=n, **kw)
        m = BERT(cfg)
        inputs = (torch.randint(0, 12, (2, 6)),)
    elif kind == "vit":
        m = ViT(ViTConfig(image_size=4, patch_size=2, n_layer=n, **kw))
        inputs = (torch.randn(2, 1, 4, 4, dtype=torch.float64),)
    else:
        cfg = EncDecConfig(
            src_vocab_size=7, tgt_vocab_size=7, max_len=8, n_layer=n // 2, **kw
        )
        m = EncoderDecoder(cfg)
        inputs = (torch.randint(0, 7, (2, 5)), torch.randint(0, 7, (2, 4)))
    m.double()
    # Weights far larger than the 0.02 init: blocks far from the identity, so a
    # wrong MGRIT iteration count shows up in the comparison.
    for mod in m.stack.modules():
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=0.5 / D**0.5)
    return m, inputs


def _loss_and_grads(model, inputs, seed=1):
    out = model(*inputs)
    torch.manual_seed(seed)
    loss = (out * torch.randn_like(out)).sum()
    loss.backward()
    return out.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _parallel(model, **kw):
    par = copy.deepcopy(model)
    par.stack = LayerParallel(par.stack.steps, t_final=1.0, **kw)
    return par


@pytest.mark.parametrize("kind", ["gpt", "bert", "vit", "encdec"])
@pytest.mark.parametrize(
    "levels,cf,n,chunks", [(2, 2, 8, 2), (2, 4, 16, 1), (3, 2, 8, 2), (3, 4, 16, 1)]
)
def test_exact_against_serial_model(kind, levels, cf, n, chunks):
    model, inputs = _model(kind, n)
    iters = n // (2 * cf)
    par = _parallel(
        model,
        levels=levels,
        cf=cf,
        chunks=chunks,
        fwd_iters=iters,
        bwd_iters=iters,
        skip_downcycle=False,
    )
    out, grads = _loss_and_grads(model, inputs)
    pout, pgrads = _loss_and_grads(par, inputs)
    assert (out - pout).abs().max() < 1e-10
    assert grads.keys() == pgrads.keys()  # same parameter names: a drop-in stack
    for name, g in grads.items():  # embeddings included: the input gradient flowed
        assert (g - pgrads[name]).abs().max() < 1e-10, name
    assert par.stack.stats.forward.converged and par.stack.stats.backward.converged


def test_too_few_iterations_are_not_exact():
    model, inputs = _model("gpt", 16)
    out, grads = _loss_and_grads(model, inputs)
    par = _parallel(model, cf=2, fwd_iters=1, bwd_iters=1)
    with pytest.warns(RuntimeWarning, match="forward solve did not converge"):
        pout, pgrads = _loss_and_grads(par, inputs)  # and it says so
    assert par.stack.stats.forward.converged is False
    assert (out - pout).abs().max() > 1e-6
    assert max((g - pgrads[k]).abs().max() for k, g in grads.items()) > 1e-6


def test_gradient_accumulation_over_micro_batches():
    model, (idx,) = _model("gpt", 8)
    # inexact on purpose (the forward reports converged=False): no warning wanted
    par = _parallel(model, cf=2, fwd_iters=2, bwd_iters=1, on_divergence="ignore")
    par(idx).pow(2).sum().backward()
    whole = {k: p.grad.clone() for k, p in par.named_parameters()}
    par.zero_grad()
    for half in (idx[:1], idx[1:]):
        par(half).pow(2).sum().backward()
    for k, p in par.named_parameters():
        assert (p.grad - whole[k]).abs().max() < 1e-12, k
    par(idx).pow(2).sum().backward()  # accumulates on top, never overwrites
    for k, p in par.named_parameters():
        assert (p.grad - 2 * whole[k]).abs().max() < 1e-12, k


def test_serial_parallel_switch_in_place():
    model, (idx,) = _model("bert", 8)
    par = _parallel(model, cf=2, fwd_iters=2, bwd_iters=2, skip_downcycle=False)
    stack = par.stack
    opt = torch.optim.SGD(par.parameters(), lr=0.1)
    for mode in ("parallel", "serial", "parallel"):
        getattr(stack, mode)()
        opt.zero_grad()
        par(idx).pow(2).mean().backward()
        assert stack.stats.mode == mode
        assert stack.mode == mode
        opt.step()
    # after three optimizer steps the two modes still compute the same function
    with torch.no_grad():
        a = par(idx)
        stack.serial()
        b = par(idx)
    assert (a - b).abs().max() < 1e-10
    assert stack.stats.serial_steps == 8 and stack.stats.forward is None


def test_dropout_masks_repeat_within_a_batch():
    model, (idx,) = _model("gpt", 8, dropout=0.3)
    par = _parallel(model, cf=2, fwd_iters=2, bwd_iters=2, skip_downcycle=False)
    par.train()
    torch.manual_seed(5)
    out_p, grads_p = _loss_and_grads(par, (idx,))
    par.zero_grad()
    par.stack.serial()
    torch.manual_seed(5)
    out_s, grads_s = _loss_and_grads(par, (idx,))
    # MGRIT re-evaluates every layer many times; its fixed point equals serial
    # execution only if each layer sees one mask per batch.
    assert (out_p - out_s).abs().max() < 1e-10
    for k, g in grads_s.items():
        assert (g - grads_p[k]).abs().max() < 1e-10, k
    torch.manual_seed(6)
    out_other, _ = _loss_and_grads(par, (idx,))
    assert (out_other - out_s).abs().max() > 1e-3  # a new batch draws new masks


def _blocks(n, seed=0):
    torch.manual_seed(seed)
    return [TransformerBlock(8, 2) for _ in range(n)]


def test_convergence_on_random_pre_ln_blocks():
    n = 64
    stack = LayerParallel(_blocks(n), cf=4, levels=2).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with torch.no_grad():
        ref = stack.serial()(x)
        stack.parallel()
        errors = []
        for iters in (1, 2, 3, 4):
            stack.fwd_options = type(stack.fwd_options)(2, 4, iters)
            errors.append((stack(x) - ref).norm().item() / ref.norm().item())
    factors = stack.stats.forward.factors
    assert len(factors) == 3 and max(factors) < 0.1, factors
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False)), errors
    assert stack.stats.forward.converged is True


def test_h_equal_one_reports_non_convergence():
    n = 64
    kw = dict(t_final=float(n), cf=4, fwd_iters=4)  # h = 1: a plain ResNet
    stack = LayerParallel(_blocks(n), **kw).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="did not converge"):
        stack(x)
    assert stack.stats.forward.converged is False
    loud = LayerParallel(_blocks(n), on_divergence="raise", **kw).double()
    with torch.no_grad(), pytest.raises(MGRITDivergenceError, match="h = 1"):
        loud(x)


def test_float32_stall_is_not_reported_as_divergence():
    # fp32 residuals stall near 1e-6 and then wobble (factor ~1); the floor
    # 100 eps ||u_C|| keeps that from reading as divergence.
    torch.manual_seed(0)
    stack = LayerParallel([TransformerBlock(16, 2) for _ in range(32)], fwd_iters=8)
    x = torch.randn(2, 8, 16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        stack(x)
    stats = stack.stats.forward
    assert stats.converged is True and stats.final_residual < stats.floor
    assert max(stats.factors[-3:]) > 0.5  # the stall really happened


def test_stats_count_work_per_cost_model():
    stack = LayerParallel(
        _blocks(16), cf=2, fwd_iters=3, bwd_iters=2, chunks=2
    ).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64, requires_grad=True)
    stack(x).sum().backward()
    fwd, bwd = stack.stats.forward, stack.stats.backward
    assert fwd.iterations == 3 and bwd.iterations == 2
    assert len(fwd.residuals) == 2 and len(bwd.residuals) == 1  # first cycle skipped
    layout, nu = stack.layout, stack.fwd_options.relax
    assert fwd.critical_path == [
        skipped_cycle_work(layout),
        *[vcycle_work(layout, nu)] * 2,
    ]
    assert stack.stats.layer_steps == fwd.total_work + bwd.total_work
    # two forwards before their backwards: each backward reports to its own call
    y1 = stack(x)
    first = stack.stats
    y2 = stack(x)
    y1.sum().backward()
    assert first.backward is not None and stack.stats.backward is None
    y2.sum().backward()
    assert stack.stats.backward is not None


def test_eval_without_grad_matches_training_output():
    stack = LayerParallel(_blocks(8), cf=2).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        a = stack(x)
    b = stack(x.requires_grad_())
    assert a.grad_fn is None and b.grad_fn is not None
    assert torch.equal(a, b.detach())


def test_warm_start_reuses_previous_trajectory():
    stack = LayerParallel(_blocks(16), cf=2, warm_start=True).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        stack(x)
        cold_final = stack.stats.forward.final_residual
        stack(x)  # same batch: the guess is already the answer
    warm = stack.stats.forward
    assert len(warm.residuals) == 2  # no skipped cycle on a warm start
    assert warm.final_residual < 1e-3 * cold_final
    with torch.no_grad():
        stack(torch.randn(2, 3, 8, dtype=torch.float64))  # new shape: cold again
    assert len(stack.stats.forward.residuals) == 1


def test_accepts_residual_stack_and_keeps_state_dict_keys():
    rs = ResidualStack(_blocks(8), t_final=1.0)
    stack = LayerParallel(rs, cf=2)
    assert stack.state_dict().keys() == rs.state_dict().keys()
    assert stack.dt == rs.dt == 1 / 8


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(t_final=0.0), ValueError, "t_final must be finite and > 0"),
        (dict(on_divergence="loud"), ValueError, "on_divergence must be one of"),
        (dict(chunks=3), ValueError, "divisible by chunks=3"),
        (dict(cf=4, levels=3), ValueError, "cf\\*\\*\\(levels-1\\)=4\\*\\*2=16"),
        (dict(relax=(1, 1)), ValueError, "relax needs one entry"),
        (dict(fwd_iters=0), ValueError, "iterations must be >= 1"),
    ],
)
def test_option_errors(kwargs, err, match):
    with pytest.raises(err, match=match):
        LayerParallel(_blocks(8), **{"cf": 2, **kwargs})


def test_input_errors():
    with pytest.raises(TypeError, match="in .steps"):
        LayerParallel(nn.Linear(2, 2))
    stack = LayerParallel(_blocks(8), cf=2)
    with pytest.raises(TypeError, match="floating Tensor"):
        stack(torch.ones(2, 3, 8, dtype=torch.long))


# ------------------------------------------------------------- the block contract
class _Widen(nn.Module):
    """Breaks the contract: maps the width ``d`` to ``2 d``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 2 * d)

    def forward(self, x, dt):
        return self.lin(x)


class _NoDt(nn.Module):
    def forward(self, x):
        return x


class _KeywordDt(nn.Module):  # the solver passes dt positionally
    def forward(self, x, *, dt):
        return x


class _OtherName(nn.Module):  # fine: the second positional argument, by any name
    def forward(self, state, h):
        return state


class _Varargs(nn.Module):
    def forward(self, x, *args):
        return x


@pytest.mark.parametrize("mode", ["parallel", "serial"])
def test_block_that_changes_the_width_is_named(mode):
    model, (idx,) = _model("gpt", 8)
    model.stack.steps[3] = _Widen(D).double()
    model.stack = getattr(LayerParallel(model.stack.steps, cf=2), mode)()
    # Before: a matmul error in block 4 (or in MGRIT's residual), naming neither.
    with pytest.raises(ValueError) as err:
        model(idx)
    assert re.search(
        r"block 3 \(_Widen\) returned a state of shape \(2, 6, 32\) for an input "
        r"of shape \(2, 6, 16\).*no block may change the state's shape",
        str(err.value),
    )
    assert "called as block(x, dt)" in str(err.value)  # the shared contract sentence


def test_sequential_of_blocks_is_a_stack():
    blocks = _blocks(8)
    ref = ResidualStack(copy.deepcopy(blocks), t_final=1.0).double()
    stack = LayerParallel(nn.Sequential(*blocks), cf=2, skip_downcycle=False).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with torch.no_grad():
        assert (stack(x) - ref(x)).abs().max() < 1e-12  # N/(2 cf) = 2 cycles: exact
    assert stack.state_dict().keys() == ref.state_dict().keys()


@pytest.mark.parametrize("kind", ["Linear", "GPT"])
def test_container_that_is_not_a_stack_says_what_is(kind):
    bad = nn.Linear(8, 8) if kind == "Linear" else _model("gpt", 8)[0]
    with pytest.raises(TypeError) as err:
        LayerParallel(bad)
    msg = str(err.value)
    assert f"got {kind}, which is none of these" in msg
    assert (
        "a list, nn.ModuleList or nn.Sequential of blocks, or a module that holds "
        "them in .steps (a leantrain ResidualStack such as model.stack)" in msg
    )
    assert "called as block(x, dt)" in msg


@pytest.mark.parametrize(
    "block,signature",
    [(_NoDt(), "(x)"), (_KeywordDt(), "(x, *, dt)"), (nn.GELU(), "(input")],
)
def test_block_without_dt_is_named(block, signature):
    with pytest.raises(TypeError) as err:
        LayerParallel([*_blocks(3), block], cf=2)
    msg = str(err.value)
    name = type(block).__name__
    assert f"block 3 ({name}) cannot be called as block(x, dt): its forward" in msg
    assert f"forward{signature}" in msg
    assert "the step size dt as its first two positional arguments" in msg
    LayerParallel([_OtherName(), _Varargs()], cf=2)  # any name, or *args: accepted


def test_stack_with_another_step_size_is_refused():
    rs = ResidualStack(_blocks(8), t_final=8.0)  # dt = 1
    # Before: LayerParallel silently ran dt = 1/8, a different network.
    with pytest.raises(
        ValueError,
        match=r"the stack steps with dt = 1 .*LayerParallel\(t_final=1\) would step "
        r"with dt = 0\.125: a different network\. Pass t_final=8 ",
    ):
        LayerParallel(rs, cf=2)
    assert LayerParallel(rs, cf=2, t_final=8.0).dt == rs.dt == 1.0


# ----------------------------------------------------- converged reflects the residual
def _report_gpt(t_final: float):
    """The user report's GPT (16 layers) with its stack made layer-parallel."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=16, d_model=64, n_head=4, t_final=t_final))
    serial = copy.deepcopy(model)
    model.stack = LayerParallel(
        model.stack, t_final=t_final, levels=2, cf=4, fwd_iters=2, bwd_iters=1
    )
    return model, serial, torch.randint(0, 256, (2, 16))


def _relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_h_equal_one_gpt_is_not_converged_and_warns_once():
    model, serial, idx = _report_gpt(16.0)  # h = 1
    with pytest.warns(RuntimeWarning) as record:
        out = model(idx)
    msg = str(record[0].message)
    assert re.search(
        r"forward solve did not converge after 2 V-cycles \(fwd_iters=2\): final "
        r"residual \S+ is \S+% of the state norm \(converged means at most 10%",
        msg,
    ), msg
    assert "h = 1 (t_final / N = 16 / 16)" in msg
    for way_out in ("smaller t_final", "more fwd_iters", 'forward_solver="serial"'):
        assert way_out in msg
    stats = model.stack.stats.forward
    # Before: converged=True, because the residuals fell (by ~0.8 per cycle).
    assert stats.history[-1] < stats.history[0] and not stats.diverged
    assert stats.converged is False and stats.relative_residual > CONVERGENCE_RTOL
    with torch.no_grad():
        assert _relative_error(out, serial(idx)) > 0.3  # truly not the serial net
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(idx).sum().backward()  # warned once per module; the adjoint only
    assert model.stack.stats.backward.converged is False  # reports its level


def test_well_posed_gpt_converges_without_warning():
    model, serial, idx = _report_gpt(1.0)  # h = 1/N: the README's configuration
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(idx)
        out.sum().backward()  # one adjoint cycle is inexact by design: no warning
    stats = model.stack.stats.forward
    assert stats.converged is True and stats.relative_residual < CONVERGENCE_RTOL
    with torch.no_grad():
        assert _relative_error(out, serial(idx)) < 2 * CONVERGENCE_RTOL


@pytest.mark.parametrize(
    "module",
    ["ode", "layout", "module", "mgrit", "adjoint"],
    ids=lambda m: f"leantrain.layer_parallel.{m}",
)
def test_docstring_examples_run(module):
    mod = getattr(lp_pkg, module)
    result = doctest.testmod(mod, extraglobs={"torch": torch})
    assert result.failed == 0 and result.attempted > 0
