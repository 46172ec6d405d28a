"""PreconditionedOptimizer: in a loop that calls loss.backward() itself, the
preconditioned gradient equals the gradient maker's on the same batches."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch

from leantrain.models.gpt import GPT, GPTConfig, lm_loss
from leantrain.precond import (
    IN_LOOP_METHODS,
    DiagonalEmpiricalFisherGradientMaker,
    GradientMaker,
    PreconditionedOptimizer,
    make_gradient_maker,
    precondition_in_loop,
)
from leantrain.precond.registry import PRECOND_METHODS
from tests._helpers.models import tiny_gpt as shared_tiny_gpt

VOCAB, T, B = 24, 6, 3
# A schedule with every branch: warm-up, EMA, curvature every 2nd and
# preconditioner every 4th step (steps reuse stale inverses and skip statistics).
SCHEDULE = {
    "damping": 1e-2,
    "ema_decay": 0.8,
    "warmup_steps": 1,
    "curvature_interval": 2,
    "preconditioner_interval": 4,
}
# The position embedding is left out of these cases (test_broadcast_positions.py
# checks it against the dense definitions).
IGNORE = {"ignore_modules": ("wpe",)}

EMP = {"fisher_type": "fisher_emp"}
CASES = {
    "kfac-emp-schedule": (
        "kfac",
        {**SCHEDULE, **IGNORE},
        {"fisher_type": "fisher_emp"},
    ),
    "kfac-mc-low-rank": ("kfac", dict(IGNORE), {}),
    "kfac-mc-2-samples": (
        "kfac",
        {**SCHEDULE, **IGNORE},
        {"fisher_type": "fisher_mc", "n_mc_samples": 2},
    ),
    "ekfac-emp": ("ekfac", {**SCHEDULE, **IGNORE}, EMP),
    "ekfac-mc": ("ekfac", dict(IGNORE), {}),
    "shampoo-schedule": ("shampoo", dict(SCHEDULE), {}),
    "shampoo-accumulate": ("shampoo_1", {"damping": 1e-3, "ema_decay": None}, {}),
    "soap-schedule": ("soap", dict(SCHEDULE), {}),
    "soap": ("soap", {}, {}),
    "ng_diag-emp": (
        "ng_diag",
        {"damping": 1e-2, **IGNORE},
        {"fisher_type": "fisher_emp"},
    ),
    "ng_unit-mc": ("ng_unit", {**SCHEDULE, **IGNORE}, {}),
    "ng_layer-emp": (
        "ng_layer",
        {"damping": 1e-1, **IGNORE},
        {"fisher_type": "fisher_emp"},
    ),
    "smw_ng": ("smw_ng", {"damping": 1e-1, **IGNORE}, {}),
    "seng": (
        "seng",
        {"damping": 1e-1, **IGNORE},
        {"sketching_size": 8, "truncated_rank": 4},
    ),
}


# tiny_gpt(seed=0): the shared builder at this file's sizes, in float64.
tiny_gpt = functools.partial(
    shared_tiny_gpt, vocab_size=VOCAB, block_size=T, d_model=8, dtype=torch.float64
)


def batches(
    n: int, batch: int = B, seed: int = 1, seq: int = T
) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, VOCAB, (batch, seq), generator=g),
            torch.randint(0, VOCAB, (batch, seq), generator=g),
        )
        for _ in range(n)
    ]


def record_steps(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list:
    """The gradients the optimizer applies, one dict per step."""
    seen: list[dict[str, torch.Tensor]] = []

    def hook(opt, args, kwargs):
        seen.append({n: p.grad.clone() for n, p in model.named_parameters()})

    optimizer.register_step_pre_hook(hook)
    return seen


def reference_run(method, config, kwargs, model, data, lr=0.05):
    """The gradient maker in its own loop (it runs forward and backward), told the
    learning rate (the KL clip's), which the loop form reads from the optimizer."""
    gm = make_gradient_maker(method, model, config=config, lr=lr, **kwargs)
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    seen = record_steps(sgd, model)
    for x, t in data:
        sgd.zero_grad()
        y = gm.setup_model_call(model, x)
        gm.setup_loss_call(lm_loss, y, t)
        gm.forward_and_backward()
        sgd.step()
    return seen, gm


def loop_run(method, config, kwargs, model, data, lr=0.05):
    """A plain PyTorch loop with the wrapped optimizer."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    seen = record_steps(sgd, model)
    opt = precondition_in_loop(sgd, model, method, config=config, **kwargs)
    for x, t in data:
        opt.zero_grad()
        lm_loss(model(x), t).backward()
        opt.step()
    return seen, opt


def assert_steps_close(got: list, want: list, tol: float = 1e-9) -> None:
    """Every applied gradient within ``tol`` of the reference, relative to its
    largest entry (float64; the two runs round differently, and six steps of
    training amplify that to ~1e-11)."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for name in w:
            err = float((g[name] - w[name]).abs().max())
            scale = float(w[name].abs().max())
            assert err <= tol * scale + 1e-300, (step, name, err, scale)


@pytest.mark.parametrize("case", sorted(CASES))
def test_in_loop_equals_gradient_maker(case):
    method, config, kwargs = CASES[case]
    model = tiny_gpt()
    data = batches(6)
    plain = copy.deepcopy(model)
    lm_loss(plain(data[0][0]), data[0][1]).backward()
    want, gm = reference_run(method, config, kwargs, copy.deepcopy(model), data)
    got, opt = loop_run(method, config, kwargs, model, data)
    assert_steps_close(got, want)
    # Step 0 is preconditioned: not the plain gradient (so agreement means something).
    change = max(
        float((got[0][n] - p.grad).abs().max() / p.grad.abs().max())
        for n, p in plain.named_parameters()
    )
    assert change > 1e-3
    assert (opt.maker.step, opt.maker.curvature_updates) == (
        gm.step,
        gm.curvature_updates,
    )


def test_preconditioned_gradient_differs_from_plain():
    model = tiny_gpt()
    ((x, t),) = batches(1)
    ref = copy.deepcopy(model)
    lm_loss(ref(x), t).backward()
    got, _ = loop_run(
        "kfac", dict(IGNORE), {"fisher_type": "fisher_emp"}, model, [(x, t)]
    )
    diff = max(
        float((got[0][n] - p.grad).abs().max()) for n, p in ref.named_parameters()
    )
    assert diff > 1e-3


@pytest.mark.parametrize(
    ("case", "fisher"),
    [
        ("kfac-emp-schedule", "fisher_emp"),
        ("kfac-mc-low-rank", "fisher_emp"),
        ("ekfac-emp", "fisher_emp"),
        ("ng_diag-emp", "fisher_emp"),
        ("kfac-mc-low-rank", "fisher_exact"),
        ("kfac-emp-schedule", "fisher_exact"),
    ],
)
def test_accumulation_equals_the_union_batch(case, fisher):
    # Two micro-batches whose losses sum to the mean over their union (the HF
    # Trainer / Lightning convention) give the maker's step on the union batch.
    # Empirical Fisher: the loop's output-gradients rescaled; exact Fisher: each
    # micro-batch's vectors rescaled to the union's. (Monte-Carlo draws on two
    # micro-batches are other samples than one draw on their union.)
    method, config, kwargs = CASES[case]
    kwargs = {**kwargs, "fisher_type": fisher}
    model = tiny_gpt()
    # The exact Fisher back-propagates one vector per position and class: short
    # sequences.
    data = batches(4, batch=2 * B, seq=2 if fisher == "fisher_exact" else T)
    want, _ = reference_run(method, config, kwargs, copy.deepcopy(model), data)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    got = record_steps(sgd, model)
    opt = precondition_in_loop(sgd, model, method, config=config, **kwargs)
    for x, t in data:
        opt.zero_grad()
        for part in (slice(0, B), slice(B, 2 * B)):
            (lm_loss(model(x[part]), t[part]) / 2).backward()
        opt.step()
    assert_steps_close(got, want)


def test_accumulation_refused_for_per_example_makers():
    model = tiny_gpt()
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "smw_ng", config=IGNORE
    )
    ((x, t),) = batches(1)
    for _ in range(2):
        lm_loss(model(x), t).backward()
    with pytest.raises(RuntimeError, match="gradient accumulation is not supported"):
        opt.step()


def test_closure_step_equals_plain_step():
    model = tiny_gpt()
    data = batches(3)
    want, _ = loop_run("kfac", dict(SCHEDULE, **IGNORE), {}, copy.deepcopy(model), data)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    got = record_steps(sgd, model)
    opt = precondition_in_loop(sgd, model, "kfac", config=dict(SCHEDULE, **IGNORE))
    for x, t in data:

        def closure(x=x, t=t):
            opt.zero_grad()
            loss = lm_loss(model(x), t)
            loss.backward()
            return loss

        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor)
    assert_steps_close(got, want)


def test_state_dict_round_trip_resumes_exactly():
    config, kwargs = dict(SCHEDULE, **IGNORE), {"fisher_type": "fisher_emp"}
    data = batches(6)
    model = tiny_gpt()
    full, _ = loop_run("kfac", config, kwargs, copy.deepcopy(model), data)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = precondition_in_loop(sgd, model, "kfac", config=config, **kwargs)
    # SGD without momentum in the uninterrupted run: compare gradients only.
    opt.optimizer.param_groups[0]["momentum"] = 0.0
    for x, t in data[:3]:
        opt.zero_grad()
        lm_loss(model(x), t).backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert "state" in saved["opt"] and "preconditioner" in saved["opt"]
    resumed = tiny_gpt(seed=5)
    resumed.load_state_dict(saved["model"])
    sgd2 = torch.optim.SGD(resumed.parameters(), lr=0.05)
    got = record_steps(sgd2, resumed)
    opt2 = precondition_in_loop(sgd2, resumed, "kfac", config=config, **kwargs)
    opt2.load_state_dict(saved["opt"])
    assert opt2.maker.step == 3
    for x, t in data[3:]:
        opt2.zero_grad()
        lm_loss(resumed(x), t).backward()
        opt2.step()
    assert_steps_close(got, full[3:])


def test_wraps_the_optimizer_fields():
    model = tiny_gpt()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = precondition_in_loop(sgd, model, "shampoo")
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is sgd.param_groups and opt.state is sgd.state
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ((x, t),) = batches(1)
    lm_loss(model(x), t).backward()
    opt.step()
    scheduler.step()
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.025)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("method", sorted(set(PRECOND_METHODS) - set(IN_LOOP_METHODS)))
def test_methods_that_need_their_own_passes_are_refused(method):
    model = tiny_gpt()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="cannot precondition inside a trainer's loop"):
        precondition_in_loop(sgd, model, method, config=IGNORE)
    maker = make_gradient_maker(method, model, config=IGNORE)
    with pytest.raises(ValueError, match=type(maker).__name__):
        PreconditionedOptimizer(sgd, maker)


def test_bad_arguments_raise():
    model = tiny_gpt()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        PreconditionedOptimizer(object(), make_gradient_maker("shampoo", model))
    with pytest.raises(TypeError, match="preconditioned gradient maker"):
        PreconditionedOptimizer(sgd, GradientMaker(model))
    with pytest.raises(ValueError, match="vmapping the model call"):
        PreconditionedOptimizer(sgd, DiagonalEmpiricalFisherGradientMaker(model))
    with pytest.raises(ValueError, match="unknown preconditioning method"):
        precondition_in_loop(sgd, model, "kfca")
    head_only = torch.optim.SGD(model.lm_head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not in the optimizer"):
        precondition_in_loop(head_only, model, "kfac", config=IGNORE)
    opt = precondition_in_loop(sgd, model, "kfac", config=IGNORE)
    with pytest.raises(ValueError, match="'preconditioner'"):
        opt.load_state_dict(sgd.state_dict())


def test_step_without_a_recorded_forward_raises():
    model = tiny_gpt()
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "kfac", config=IGNORE
    )
    ((x, t),) = batches(1)
    with torch.no_grad():
        model(x)  # evaluation: not recorded
    logits = model.head(model.stack(model.embed(x)))  # bypasses model.forward
    lm_loss(logits, t).backward()
    with pytest.raises(RuntimeError, match="no call of the model"):
        opt.step()


def test_non_finite_step_is_skipped_without_a_trace():
    # As the maker: a NaN gradient skips the whole step as GradScaler would (no
    # optimizer step, factors, EMA and inverses as they were, the step counter
    # kept), warns and counts it.
    model = tiny_gpt()
    config = {"damping": 1e-2, "ema_decay": 0.8, **IGNORE}
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "kfac_1", config=config
    )
    (x, t), (x2, t2) = batches(2)
    lm_loss(model(x), t).backward()
    opt.step()
    before = copy.deepcopy(opt.maker.state_dict())
    opt.zero_grad()
    params = copy.deepcopy(model.state_dict())
    (lm_loss(model(x2), t2) * float("nan")).backward()
    with pytest.warns(RuntimeWarning, match="non-finite gradient at step 1"):
        opt.step()
    after = opt.maker.state_dict()
    assert opt.maker.skipped_curvature_updates == 1 == opt.maker.nonfinite_steps
    assert after["curvature_updates"] == before["curvature_updates"] == 1
    assert after["step"] == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, params[key])
    for key, value in before["extra"]["factors"].items():
        torch.testing.assert_close(after["extra"]["factors"][key], value)


def test_gefen_applies_the_preconditioned_gradient():
    # Any optimizer can be wrapped: Gefen steps with the maker's gradient.
    from leantrain.optim import Gefen

    model, data = tiny_gpt(), batches(3)
    ref = copy.deepcopy(model)
    gm = make_gradient_maker("shampoo", ref)
    ref_opt = Gefen(ref.parameters(), lr=1e-2)
    opt = precondition_in_loop(Gefen(model.parameters(), lr=1e-2), model, "shampoo")
    for x, t in data:
        ref_opt.zero_grad()
        y = gm.setup_model_call(ref, x)
        gm.setup_loss_call(lm_loss, y, t)
        gm.forward_and_backward()
        ref_opt.step()
        opt.zero_grad()
        lm_loss(model(x), t).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-15)
    assert not torch.equal(model.lm_head.weight, tiny_gpt().lm_head.weight)


def test_hooks_only_before_curvature_steps_and_close_removes_them():
    model = tiny_gpt()
    config = {"curvature_interval": 2, "preconditioner_interval": 2, **IGNORE}
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.05), model, "kfac", config=config
    )

    def hooked() -> int:
        return sum(len(m._forward_hooks) for m in model.modules())

    assert hooked() > 0  # step 0 updates the curvature
    ((x, t),) = batches(1)
    lm_loss(model(x), t).backward()
    opt.step()
    assert hooked() == 0  # step 1 does not: no hooks, no cost
    lm_loss(model(x), t).backward()
    opt.step()
    assert hooked() > 0
    opt.close()
    assert hooked() == 0


def test_more_than_one_process_is_refused(monkeypatch):
    import leantrain.precond.in_loop as in_loop

    monkeypatch.setattr(in_loop, "_is_distributed", lambda: True)
    model = tiny_gpt()
    with pytest.raises(NotImplementedError, match="single process"):
        precondition_in_loop(torch.optim.SGD(model.parameters(), lr=0.1), model, "kfac")


def test_in_loop_argument_errors():
    model = torch.nn.Linear(4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="accumulation_steps=2 is for the maker"):
        precondition_in_loop(sgd, model, "kfac", config={"accumulation_steps": 2})
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        precondition_in_loop(sgd, model, "kfac", grad_scaler="scaler")


def test_step_skipped_by_the_scaler_between_curvature_steps_leaves_no_trace():
    # Curvature every 2nd step (Monte-Carlo draws); the scaler skips step 1, which
    # records nothing: the run equals one that never saw that batch.
    torch.manual_seed(0)
    initial = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    ).double()
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.arange(8) % 3)
        for _ in range(6)
    ]
    data[1][0][0, 0] = float("inf")
    config = {"curvature_interval": 2, "preconditioner_interval": 2}

    def run(batches, scaler):
        model = copy.deepcopy(initial)
        opt = precondition_in_loop(
            torch.optim.SGD(model.parameters(), lr=0.1), model, "kfac", config=config
        )
        for x, t in batches:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), t)
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
        return [p.detach() for p in model.parameters()]

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    got = run(data, scaler)
    want = run(data[:1] + data[2:], None)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_deep_copy_of_the_model_is_not_recorded():
    # copy.deepcopy copies the hooks too; the copy's calls must not be recorded.
    torch.manual_seed(0)
    initial = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    ).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    t = torch.arange(8) % 3

    def run(with_copy):
        model = copy.deepcopy(initial)
        opt = precondition_in_loop(
            torch.optim.SGD(model.parameters(), lr=0.1), model, "kfac"
        )
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), t).backward()
            if with_copy:  # e.g. a teacher or EMA copy run with gradients
                twin = copy.deepcopy(model)
                torch.nn.functional.cross_entropy(twin(x * 2), t).backward()
            opt.step()
        return [p.detach() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


def _hook_guard_option():
    import torch._dynamo

    return torch._dynamo.config.skip_nnmodule_hook_guards


def _kfac_loop():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "kfac", **EMP
    )
    return model, opt


def test_hook_guards_are_on_while_open_and_restored_as_found(set_attribute):
    import gc

    import torch._dynamo

    for found in (True, False):  # dynamo's default, then a user's own choice
        set_attribute(torch._dynamo.config, "skip_nnmodule_hook_guards", found)
        _, first = _kfac_loop()
        _, second = _kfac_loop()
        assert _hook_guard_option() is False
        first.close()
        assert _hook_guard_option() is False  # the second still records
        first.close()  # closing twice gives back one lease, once
        assert _hook_guard_option() is False
        del second
        gc.collect()  # a collected optimizer gives its lease back too
        assert _hook_guard_option() is found
    model = torch.nn.Linear(4, 3)
    shampoo = precondition_in_loop(
        torch.optim.SGD(model.parameters(), lr=0.1), model, "shampoo"
    )
    assert _hook_guard_option() is False  # the value the loop above left
    shampoo.close()


def test_compiles_after_close_see_dynamo_as_found(set_attribute):
    import torch._dynamo

    set_attribute(torch._dynamo.config, "skip_nnmodule_hook_guards", True)
    model, opt = _kfac_loop()
    x = torch.randn(8, 4)
    compiled = torch.compile(model, backend="eager")
    compiled(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    opt.close()
    assert _hook_guard_option() is True
    other = torch.nn.Linear(4, 2)
    torch.compile(other, backend="eager")(x).sum().backward()  # builds its guards
    assert other.weight.grad is not None


@pytest.mark.parametrize("method", ["kfac", "shampoo"])
def test_preconditioner_state_of_another_model_is_refused_by_name(method):
    def trained(config: GPTConfig):
        torch.manual_seed(0)
        model = GPT(config).double()
        opt = precondition_in_loop(
            torch.optim.SGD(model.parameters(), lr=0.05), model, method, config=IGNORE
        )
        x, t = batches(1)[0]
        lm_loss(model(x), t).backward()
        opt.step()
        return opt

    base = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, d_model=8)
    saved = trained(base).state_dict()
    wider = trained(GPTConfig(**{**base.__dict__, "d_model": 12}))
    step_before = wider.maker.step
    with pytest.raises(
        ValueError, match=r"module '\S+' has parameter shapes \[\["
    ) as err:
        wider.load_state_dict(saved)
    assert "12]] here but [[24, 8]] in the state" in str(err.value)
    assert wider.maker.step == step_before  # nothing loaded
    deeper = trained(GPTConfig(**{**base.__dict__, "n_layer": 3}))
    with pytest.raises(ValueError, match=r"the state has no module 'stack.steps.2"):
        deeper.maker.load_state_dict(saved["preconditioner"])
