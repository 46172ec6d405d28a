"""``leantrain.compare.precond_step`` on a tiny GPT on CPU: the arms it builds are the
ones the registry's schedules imply, the schedule mean is ``schedule_mean_step`` of
its own arms, the floors are the step-cost counts of the makers, and the refresh
arms' configs refresh what they claim (read from ``PreconditioningConfig`` itself)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leantrain.compare.optimizer_step import Clock
from leantrain.compare.precond_step import (
    NEVER,
    PrecondMethod,
    measure,
    refresh_arms,
    registry_intervals,
)
from leantrain.models.gpt import GPT, GPTConfig
from leantrain.precond import (
    IN_LOOP_METHODS,
    PRECOND_METHODS,
    PreconditioningConfig,
    make_gradient_maker,
)
from leantrain.precond.step_cost import (
    application_macs,
    forward_backward_macs,
    schedule_mean_step,
)

SEQ = 8
METHODS = ["kfac", "shampoo", "soap", "psgd"]


class CountingClock:
    """Runs each step and returns a made-up time; counts the steps."""

    def __init__(self) -> None:
        self.calls = 0

    def time(self, fn) -> float:
        fn()
        self.calls += 1
        return 1e-3 * (1 + self.calls % 7)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, block_size=SEQ))


def _batch():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, 256, (2, SEQ), generator=g) for _ in range(2))


def _measure(model, methods, clock, **kwargs):
    return measure(
        model,
        _batch(),
        methods,
        base=lambda method, ps: torch.optim.SGD(ps, lr=1e-3),
        references={"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3)},
        reference="adamw",
        clock=clock,
        **kwargs,
    )


# PSGD leaves the embedding and norms to the plain gradient and says so
@pytest.mark.filterwarnings("ignore:PsgdGradientMaker does not precondition")
@pytest.mark.parametrize("per_method", [False, True])
def test_arms_means_and_floors_follow_the_registry(per_method):
    model = _gpt()
    clock = CountingClock()
    costs = _measure(
        model, METHODS, clock, steps=2, warmup=1, refresh_steps=1,
        refresh_warmup=0, per_method=per_method,
    )  # fmt: skip
    expected_arms = {"adamw": ("adamw", "reference")}
    for m in METHODS:
        forms = ["loop", "maker"] if m in IN_LOOP_METHODS else ["maker"]
        expected_arms |= {f"{m} {f}": (m, f) for f in forms}
        expected_arms |= {f"{m} {k}": (m, k) for k in refresh_arms(m, ("wpe",))}
        assert costs.plain[m] == f"{m} {forms[0]}"
    assert costs.arms == expected_arms
    assert set(costs.medians) == set(expected_arms)
    # 3 rounds of the reference and plain arms, 1 of each refresh arm
    plain = sum(
        kind in ("reference", "loop", "maker") for _, kind in costs.arms.values()
    )
    assert clock.calls == 3 * plain + (len(expected_arms) - plain)
    per_token = forward_backward_macs(model, SEQ)
    for m in METHODS:
        c, i = registry_intervals(m)
        config = dataclasses.replace(
            PreconditioningConfig(), **PRECOND_METHODS[m].config
        )
        assert costs.intervals[m] == (c, i)
        assert (c, i) == (config.curvature_interval, config.preconditioner_interval)
        med = costs.medians
        refresh = med[f"{m} refresh"]
        curvature = med.get(f"{m} curvature", refresh)
        assert costs.means[m] == schedule_mean_step(
            med[costs.plain[m]], curvature, refresh, c, i
        )
        gm = make_gradient_maker(m, _gpt(), config={"ignore_modules": ("wpe",)})
        floor = 1 + application_macs(gm) / (2 * SEQ * per_token)
        assert costs.floors[m] == pytest.approx(floor)
    assert costs.x_reference(costs.medians["adamw"]) == 1.0


def test_the_arms_configs_refresh_what_they_claim():
    for method in ("kfac", "ekfac", "shampoo", "soap"):
        c, i = registry_intervals(method)
        arms = refresh_arms(method)
        assert ("curvature" in arms) == (i > c)
        for kind, fields in arms.items():
            # as the maker builds it: the registry's config, the arm's on top
            config = PreconditioningConfig(
                **{**PRECOND_METHODS[method].config, **fields}
            )
            for step in range(1, 6):
                assert config.curvature_due(step)
                assert config.preconditioner_due(step) == (kind == "refresh")
    plain = PreconditioningConfig(
        curvature_interval=NEVER, preconditioner_interval=NEVER
    )
    assert plain.preconditioner_due(0) and not plain.curvature_due(1)


def test_the_timed_step_is_the_whole_step_with_the_method_labelled():
    """A row with maker options (the empirical Fisher) is its own method."""
    costs = _measure(
        _gpt(), [PrecondMethod("kfac", "kfac emp", {"fisher_type": "fisher_emp"})],
        Clock(torch.device("cpu")), steps=1, warmup=0, forms=("loop",),
    )  # fmt: skip
    assert set(costs.medians) == {"adamw", "kfac emp loop", "kfac emp refresh"}
    assert all(sec > 0 for sec in costs.medians.values())


@pytest.mark.parametrize(
    ("methods", "kwargs", "message"),
    [
        (["psgd"], {"forms": ("loop",)}, "method 'psgd' cannot run in the loop"),
        (["kfac9"], {}, "unknown preconditioning method 'kfac9'"),
        (["kfac"], {"steps": 0}, "steps must be an int >= 1, got 0"),
        (["kfac"], {"forms": ("fused",)}, "forms must be a non-empty subset"),
        (["kfac", "kfac"], {}, "distinct labels"),
    ],
)
def test_bad_arguments_are_refused_by_value(methods, kwargs, message):
    kwargs = {"steps": 1, "warmup": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        _measure(_gpt(), methods, CountingClock(), **kwargs)
