"""A preconditioned step that refreshes nothing, against its arithmetic floor (CPU).

On an 8-layer d 256 :class:`~leantrain.models.GPT` (causal LM on random bytes,
context 64), for each number of tokens per step ``N`` (batch x 64), the arms take
turns on the same batch from the same init:

* **sgd**, **adamw**: ``loss.backward(); opt.step()``, the base step;
* **<method> loop**: ``loss.backward(); wrapped.step()`` with
  :func:`~leantrain.precond.precondition_in_loop` around the same SGD;
* **<method> maker**: ``gm.forward_and_backward(); sgd.step()``.

Curvature and preconditioner are refreshed at step 0 (in the warm-up), then never
again (both intervals beyond the run), so every timed step only applies the
preconditioner. Printed per arm: the median CPU time of the timed steps
(``time.process_time``; ``torch.set_num_threads`` as ``--threads``, 1 by default:
the machine is shared, so wall time is not meaningful), its ratio to SGD's median
of the same run, and the **floor**: the ratio the multiply-adds alone predict,
``1 + c * sum m n (m + n) / (3 N * base MACs per token)`` over the method's
preconditioned ``m x n`` weight matrices
(:func:`~leantrain.precond.step_cost.application_macs`, ``c`` per method), the base
being the model's forward and backward
(:func:`~leantrain.precond.step_cost.forward_backward_macs`). **/ floor** is the
overhead left beyond the arithmetic.

With ``--schedule``, each method also runs with the registry's own schedule, as
two more arms that refresh on every step: one updates the curvature only (the
preconditioner never), one both. A run with the registry's schedule is periodic
(curvature every ``C`` steps, the preconditioner every ``I``, ``I`` a multiple of
``C``), so its mean step is, per period of ``I`` steps,
``((I - I/C) * plain + (I/C - 1) * curvature + refresh) / I`` of the three medians;
printed against AdamW's median (the **mean x adamw** column).

Run: ``python benchmarks/precond_step.py --tokens 512,2048,8192`` (about 6 minutes
on one thread). PSGD runs through the maker only (it cannot run inside a loop).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

from leantrain.models.gpt import GPT, GPTConfig, lm_loss
from leantrain.precond import make_gradient_maker, precondition_in_loop
from leantrain.precond.registry import PRECOND_METHODS
from leantrain.precond.step_cost import (
    application_macs,
    forward_backward_macs,
    schedule_mean_step,
)

SEQ = 64
# The position embedding sees (T,) positions, not the batch: the hooks skip it.
# Refreshed at step 0 only: every timed step applies a stored preconditioner.
NEVER = 10**9
CONFIG = {
    "ignore_modules": ("wpe",),
    "curvature_interval": NEVER,
    "preconditioner_interval": NEVER,
}
IN_LOOP = ("kfac", "ekfac", "shampoo", "soap")
MAKER_ONLY = ("psgd",)
LR = 1e-3  # small: nothing moves far in a few steps of random bytes


def _base(model: GPT, opt: torch.optim.Optimizer) -> Callable:
    def step(x, t):
        opt.zero_grad()
        lm_loss(model(x), t).backward()
        opt.step()

    return step


def _loop(model: GPT, method: str, config: dict = CONFIG) -> Callable:
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    opt = precondition_in_loop(sgd, model, method, config=dict(config))
    return _base(model, opt)


def _maker(model: GPT, method: str, config: dict = CONFIG) -> tuple[Callable, object]:
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    gm = make_gradient_maker(method, model, config=dict(config))
    gm.lr = LR  # the KL clip (K-FAC, EKFAC) runs as it does in the loop

    def step(x, t):
        sgd.zero_grad()
        y = gm.setup_model_call(model, x)
        gm.setup_loss_call(lm_loss, y, t)
        gm.forward_and_backward()
        sgd.step()

    return step, gm


def registry_intervals(method: str) -> tuple[int, int]:
    """(curvature, preconditioner) interval of the method's registry schedule."""
    config = PRECOND_METHODS[method].config
    curvature = config.get("curvature_interval", 1)
    return curvature, config.get("preconditioner_interval", curvature)


def refresh_arms(method: str) -> dict[str, dict]:
    """The configs of the arms that refresh on every step: the curvature only
    (when the schedule has curvature steps without a preconditioner update), and
    both."""
    ignore = {"ignore_modules": CONFIG["ignore_modules"]}
    every = {**ignore, "curvature_interval": 1, "preconditioner_interval": 1}
    curvature, preconditioner = registry_intervals(method)
    arms = {"refresh": every}
    if preconditioner > curvature:
        arms["curvature"] = {**every, "preconditioner_interval": NEVER}
    return arms


def schedule_mean(method: str, med: dict[str, float]) -> float:
    """The mean step of a run with the registry's schedule (see the docstring)."""
    form = "loop" if method in IN_LOOP else "maker"
    plain, refresh = med[f"{method} {form}"], med[f"{method} refresh"]
    curvature = med.get(f"{method} curvature", refresh)
    return schedule_mean_step(plain, curvature, refresh, *registry_intervals(method))


def time_tokens(
    n_tokens: int, methods: list[str], steps: int, warmup: int, schedule: bool = False
) -> tuple[dict[str, float], dict[str, float]]:
    """Median CPU seconds per step of every arm at ``n_tokens``, and each method's
    floor; with ``schedule``, the refresh arms too (:func:`refresh_arms`)."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=8, d_model=256, n_head=4, block_size=SEQ))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n_tokens // SEQ, SEQ), generator=g)
    t = torch.randint(0, 256, (n_tokens // SEQ, SEQ), generator=g)
    arms: dict[str, Callable] = {}
    sgd_model = copy.deepcopy(base)
    arms["sgd"] = _base(sgd_model, torch.optim.SGD(sgd_model.parameters(), lr=LR))
    adamw_model = copy.deepcopy(base)
    arms["adamw"] = _base(
        adamw_model, torch.optim.AdamW(adamw_model.parameters(), lr=LR)
    )
    per_token = forward_backward_macs(base, SEQ)
    floors: dict[str, float] = {}
    for method in methods:
        if method in IN_LOOP:
            arms[f"{method} loop"] = _loop(copy.deepcopy(base), method)
        arms[f"{method} maker"], gm = _maker(copy.deepcopy(base), method)
        floors[method] = 1.0 + application_macs(gm) / (n_tokens * per_token)
        for kind, config in (refresh_arms(method) if schedule else {}).items():
            model = copy.deepcopy(base)
            if method in IN_LOOP:
                arms[f"{method} {kind}"] = _loop(model, method, config)
            else:
                arms[f"{method} {kind}"] = _maker(model, method, config)[0]
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(warmup + steps):
        for name, step in arms.items():
            start = time.process_time()
            step(x, t)
            times[name].append(time.process_time() - start)
    return {k: statistics.median(v[warmup:]) for k, v in times.items()}, floors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--methods", default=",".join(IN_LOOP + MAKER_ONLY))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--schedule",
        action="store_true",
        help="also time refresh steps and print the mean step of a run with the "
        "registry's schedule against AdamW's",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    for n_tokens in (int(n) for n in args.tokens.split(",")):
        if n_tokens % SEQ:
            raise ValueError(f"--tokens {n_tokens} is not a multiple of {SEQ}")
        med, floors = time_tokens(
            n_tokens, methods, args.steps, args.warmup, args.schedule
        )
        print(
            f"\nN = {n_tokens} tokens ({n_tokens // SEQ} x {SEQ}), "
            f"{args.threads} thread(s), median of {args.steps} steps"
        )
        print(f"{'arm':16s} {'step ms':>9s} {'x sgd':>7s} {'floor':>7s} /floor")
        for name, sec in med.items():
            ratio = sec / med["sgd"]
            method = name.split()[0]
            if method in floors:
                floor = floors[method]
                print(
                    f"{name:16s} {sec * 1e3:9.1f} {ratio:7.2f} {floor:7.3f} "
                    f"{ratio / floor:8.2f}"
                )
            else:
                print(f"{name:16s} {sec * 1e3:9.1f} {ratio:7.2f}")
        if args.schedule:
            print(f"\n{'method':10s} {'schedule (C, I)':>16s} {'mean x adamw':>13s}")
            for method in methods:
                mean = schedule_mean(method, med) / med["adamw"]
                print(
                    f"{method:10s} {str(registry_intervals(method)):>16s} {mean:13.2f}"
                )


if __name__ == "__main__":
    main()
