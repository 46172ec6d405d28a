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

The measurement is :func:`leantrain.compare.precond_step.measure` (every arm on
its own copy of the model, one step of each per round); this script builds the
model and batch and prints its tables.

Run: ``python benchmarks/precond_step.py --tokens 512,2048,8192`` (about 6 minutes
on one thread). PSGD runs through the maker only (it cannot run inside a loop).
"""

from __future__ import annotations

import argparse
import time

import torch

from leantrain.compare.optimizer_step import Clock
from leantrain.compare.precond_step import StepCosts, measure, registry_intervals
from leantrain.models.gpt import GPT, GPTConfig

SEQ = 64
IN_LOOP = ("kfac", "ekfac", "shampoo", "soap")
MAKER_ONLY = ("psgd",)
LR = 1e-3  # small: nothing moves far in a few steps of random bytes


def time_tokens(
    n_tokens: int, methods: list[str], steps: int, warmup: int, schedule: bool = False
) -> StepCosts:
    """Every arm at ``n_tokens`` tokens a step, around SGD, with SGD and AdamW as
    the references, in turns on the CPU's process time."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, d_model=256, n_head=4, block_size=SEQ))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n_tokens // SEQ, SEQ), generator=g)
    t = torch.randint(0, 256, (n_tokens // SEQ, SEQ), generator=g)
    return measure(
        model,
        (x, t),
        methods,
        base=lambda method, ps: torch.optim.SGD(ps, lr=LR),
        references={
            "sgd": lambda ps: torch.optim.SGD(ps, lr=LR),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR),
        },
        reference="adamw",
        clock=Clock(torch.device("cpu"), time_fn=time.process_time),
        steps=steps,
        warmup=warmup,
        schedule=schedule,
    )


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
        costs = time_tokens(n_tokens, methods, args.steps, args.warmup, args.schedule)
        med = costs.medians
        print(
            f"\nN = {n_tokens} tokens ({n_tokens // SEQ} x {SEQ}), "
            f"{args.threads} thread(s), median of {args.steps} steps"
        )
        print(f"{'arm':16s} {'step ms':>9s} {'x sgd':>7s} {'floor':>7s} /floor")
        for name, sec in med.items():
            ratio = sec / med["sgd"]
            method = costs.arms[name][0]
            if method in costs.floors:
                floor = costs.floors[method]
                print(
                    f"{name:16s} {sec * 1e3:9.1f} {ratio:7.2f} {floor:7.3f} "
                    f"{ratio / floor:8.2f}"
                )
            else:
                print(f"{name:16s} {sec * 1e3:9.1f} {ratio:7.2f}")
        if args.schedule:
            print(f"\n{'method':10s} {'schedule (C, I)':>16s} {'mean x adamw':>13s}")
            for method in methods:
                mean = costs.x_reference(costs.means[method])
                print(
                    f"{method:10s} {str(registry_intervals(method)):>16s} {mean:13.2f}"
                )


if __name__ == "__main__":
    main()
