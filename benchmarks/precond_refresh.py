"""A preconditioner refresh batched over same-shaped factors against one factor at a
time (CPU).

On a GPT of ``--layers`` blocks of width ``--width`` (ignoring the position table),
one curvature pass of Shampoo and of K-FAC (interval 10) fills their factors; then,
in turns, the refresh as the makers run it (``update_preconditioner``: Shampoo's
inverse roots from one batched ``eigh`` per shape and exponent, K-FAC's damped
inverses from one batched Cholesky per shape) and the same refresh one factor at a
time (``inverse_root`` / ``damped_inverse`` per factor, the makers' former loop).

Printed: median CPU time of each (``time.process_time``, one thread), batched over
one-at-a-time from the same run, and how many factors fall into how many groups.
On CPU LAPACK factors a batch member by member, so the two cost about the same; the
batch saves calls and, on a GPU, a device wait per factor.

Run: ``python benchmarks/precond_refresh.py`` (12 layers, width 128, 5 repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leantrain.models.gpt import GPT, GPTConfig, lm_loss
from leantrain.precond import make_gradient_maker
from leantrain.precond.curv import damped_inverse
from leantrain.precond.methods.shampoo import inverse_root


def _filled(method: str, model: GPT, x, y):
    gm = make_gradient_maker(method, model, config={"ignore_modules": ("wpe",)})
    gm.setup_loss_call(lm_loss, gm.setup_model_call(model, x), y)
    gm.forward_and_backward()  # step 0: curvature and preconditioner
    return gm


def _shampoo_one_by_one(gm) -> None:
    eps = gm.config.damping
    for blocks in gm.statistics.values():
        for stats in blocks:
            for s in stats:
                inverse_root(s, 2.0 if len(stats) == 1 else 4.0, eps)


def _kfac_dense(gm) -> list[tuple[str, str]]:
    """(name, "A" | "B") of the dense factors (LayerNorms have unit blocks)."""
    return [(n, k) for n, f in gm.factors.items() if "A" in f for k in "AB"]


def _kfac_one_by_one(gm) -> None:
    dense = _kfac_dense(gm)
    damps = gm._dense_dampings(dense, gm.config.damping)
    mats = [m for n, k in dense for m in gm.factors[n][k]]
    for m, d in zip(mats, damps, strict=True):
        damped_inverse(m, d)


def _count(matrices) -> tuple[int, int]:
    return len(matrices), len({(m.shape, m.dtype) for m in matrices})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, d_model=args.width, block_size=64))
    x, y = torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64))
    shampoo = _filled("shampoo", model, x, y)
    kfac = _filled("kfac", model, x, y)
    cases = {
        "shampoo": (shampoo, _shampoo_one_by_one),
        "kfac": (kfac, _kfac_one_by_one),
    }
    stats = [s for b in shampoo.statistics.values() for t in b for s in t]
    dense = [m for n, k in _kfac_dense(kfac) for m in kfac.factors[n][k]]
    groups = {"shampoo": _count(stats), "kfac": _count(dense)}
    print(f"GPT {args.layers} x {args.width}, one thread, CPU seconds, median of "
          f"{args.repeats}\n")  # fmt: skip
    print("| method | factors (shapes) | batched ms | one by one ms | batched / one |")
    print("|---|---|---:|---:|---:|")
    for name, (gm, one_by_one) in cases.items():
        batched, single = [], []
        for _ in range(args.repeats):
            start = time.process_time()
            gm.update_preconditioner()
            batched.append(time.process_time() - start)
            start = time.process_time()
            one_by_one(gm)
            single.append(time.process_time() - start)
        b, s = statistics.median(batched), statistics.median(single)
        n, shapes = groups[name]
        print(
            f"| {name} | {n} ({shapes}) | {b * 1e3:.1f} | {s * 1e3:.1f} | {b / s:.2f} |"
        )


if __name__ == "__main__":
    main()
