"""Step time of preconditioning inside your loop against the gradient maker (CPU).

For K-FAC (Monte-Carlo and empirical Fisher) and Shampoo with the registry's
defaults, on a small :class:`~leantrain.models.GPT` (2 layers, d 64, 8 x 32 tokens),
from the same init and on the same batch, three forms of one training step take
turns:

* **plain**: ``loss.backward(); sgd.step()``;
* **maker**: ``gm.forward_and_backward(); sgd.step()``;
* **loop**: ``loss.backward(); wrapped.step()`` with
  :func:`~leantrain.precond.precondition_in_loop`.

Printed: the median CPU time of a step (``time.process_time``, one thread: the
shared machine's load makes wall time meaningless) after a warm-up, its ratio to
the plain step of the same run, and loop / maker. ``--repeats N`` runs the whole
timing N times and prints the median ratio and the range.

``--plain`` times the steps between refreshes instead (curvature and preconditioner
at step 0 only, inside the warm-up): what preconditioning adds to a step that only
applies it.

Run: ``OMP_NUM_THREADS=1 python benchmarks/precond_in_loop.py --repeats 3 [--plain]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from leantrain.models.gpt import GPT, GPTConfig, lm_loss
from leantrain.precond import make_gradient_maker, precondition_in_loop

# The position embedding sees (T,) positions, not the batch: the hooks skip it.
CONFIG = {"ignore_modules": ("wpe",)}
# --plain: curvature and preconditioner at step 0 only (the warm-up), so the timed
# steps are plain steps: what a step between refreshes costs.
PLAIN = {"curvature_interval": 10_000, "preconditioner_interval": 10_000}
METHODS = {
    "kfac (MC)": ("kfac", {}),
    "kfac (emp)": ("kfac", {"fisher_type": "fisher_emp"}),
    "shampoo": ("shampoo", {}),
}


def _plain(model):
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x, t):
        sgd.zero_grad()
        lm_loss(model(x), t).backward()
        sgd.step()

    return step


def _maker(model, method, kwargs, config):
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    gm = make_gradient_maker(method, model, config=config, lr=0.01, **kwargs)

    def step(x, t):
        sgd.zero_grad()
        y = gm.setup_model_call(model, x)
        gm.setup_loss_call(lm_loss, y, t)
        gm.forward_and_backward()
        sgd.step()

    return step


def _loop(model, method, kwargs, config):
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = precondition_in_loop(sgd, model, method, config=config, **kwargs)

    def step(x, t):
        opt.zero_grad()
        lm_loss(model(x), t).backward()
        opt.step()

    return step


def time_once(steps: int, warmup: int, plain: bool = False) -> dict[str, float]:
    """Median CPU seconds per step of every form, measured in turns."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=2, d_model=64, n_head=2, block_size=32))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (8, 32), generator=g)
    t = torch.randint(0, 256, (8, 32), generator=g)
    forms = {"plain": _plain(copy.deepcopy(base))}
    for name, (method, kwargs) in METHODS.items():
        config = {**CONFIG, **PLAIN} if plain else CONFIG
        forms[f"{name} maker"] = _maker(copy.deepcopy(base), method, kwargs, config)
        forms[f"{name} loop"] = _loop(copy.deepcopy(base), method, kwargs, config)
    times: dict[str, list[float]] = {k: [] for k in forms}
    for _ in range(warmup + steps):
        for name, step in forms.items():
            start = time.process_time()
            step(x, t)
            times[name].append(time.process_time() - start)
    return {k: statistics.median(v[warmup:]) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--plain",
        action="store_true",
        help="time steps between refreshes (curvature and preconditioner at step 0)",
    )
    args = parser.parse_args()
    runs = [time_once(args.steps, args.warmup, args.plain) for _ in range(args.repeats)]
    first = runs[0]
    print(f"{'form':20s} {'step ms':>8s} {'x plain':>8s}  (range over repeats)")
    for name in first:
        ratios = [r[name] / r["plain"] for r in runs]
        print(
            f"{name:20s} {first[name] * 1e3:8.2f} {statistics.median(ratios):8.2f}"
            f"  ({min(ratios):.2f}-{max(ratios):.2f})"
        )
    for name in METHODS:
        ratios = [r[f"{name} loop"] / r[f"{name} maker"] for r in runs]
        print(
            f"{name}: loop / maker {statistics.median(ratios):.2f}"
            f"  ({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
