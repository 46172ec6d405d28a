"""Every preconditioning method against SGD and AdamW on the digits (CPU, 1 thread).

For each model (the 64-256-256-10 MLP, the small CNN of ``leantrain.models`` with
widths 16-32-32, and a tiny 64-16-10 MLP where the dense methods fit) and each method of
``leantrain.precond.registry`` plus plain SGD and AdamW, from the same init and the
same batches (128 examples):

* **step ms / x SGD** -- median CPU time (``time.process_time``: the shared machine's
  load makes wall time meaningless; with one thread it is the wall time of an idle
  machine) of one whole training step (zero_grad,
  ``forward_and_backward`` or forward + backward, ``optimizer.step``) after a warm-up,
  and its ratio to the plain SGD step of the same model measured in the same run. The
  methods take turns, 10 steps each, so a load change on the machine hits them all
  alike. With ``--repeats N`` the whole timing runs N times and **x SGD** is the
  median of the N ratios, their range printed after the note (step ms and the
  losses are those of the first run);
* **mean x** -- the mean step time over the same steps, as a ratio to SGD's mean
  (with ``--repeats``, the median of those ratios). For a method that updates its
  curvature every k steps the median step is one that only applies the stored
  preconditioner; the mean also carries the curvature and inversion steps, which
  is what a training run pays on average;
* **steps to target** -- the first evaluation step (every ``--eval-every``) at which
  the loss on the whole training set reaches AdamW's loss after ``--steps`` steps
  (``-`` if never); **final loss** -- that loss at the end.

Preconditioned methods feed ``torch.optim.SGD(momentum=0.9)`` with the registry's
learning rate. A method that is missing, too big for the model (dense ``P x P``
matrices) or fails shows why in the table. BatchNorm of the CNN stays in training
mode (batch statistics treated as constants by the hook-based methods). A PNG of the
loss curves is written next to ``--out``.

Usage::

    python benchmarks/precond.py                      # a few minutes
    python benchmarks/precond.py --full               # 500 steps
    python benchmarks/precond.py --models mlp --methods kfac_1,kfac,seng
    python benchmarks/precond.py --models mlp --methods kfac_1,kfac --repeats 5
    python benchmarks/precond.py --models mlp,cnn \
        --methods kfac_1,kfac,shampoo,asdl_kfac,asdl_kfac_10,asdl_shampoo_10

``asdl_*`` methods run ASDL's own makers (``ASDL_PEERS``) in the same turns, when
ASDL is installed: the anchors' ratios measured side by side, not quoted.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from leantrain.data import load_digits
from leantrain.models import CNN, MLP
from leantrain.precond import GradientMaker
from leantrain.precond.registry import (
    PRECOND_METHODS,
    MethodUnavailableError,
    make_gradient_maker,
)

MODELS = {
    "mlp": lambda: MLP((64, 256, 256, 10)),
    "cnn": lambda: CNN(widths=(16, 32, 32)),
    "tiny": lambda: MLP((64, 16, 10)),
}
# ASDL's makers as peers, when installed (``pip install --no-deps asdfghjkl==0.1a5``):
# name -> (class, curvature and preconditioner interval, kwargs). Damping 1: smaller
# values crash its float32 Cholesky on the MLP (the π-split leaves a factor
# indefinite); the damping does not change the cost of a step.
ASDL_PEERS = {
    "asdl_kfac": ("KfacGradientMaker", 1, {"fisher_type": "fisher_mc"}),
    "asdl_kfac_10": ("KfacGradientMaker", 10, {"fisher_type": "fisher_mc"}),
    "asdl_shampoo_10": ("ShampooGradientMaker", 10, {}),
}
ASDL_DAMPING = 1.0
DENSE_LIMIT = 4096  # parameters: dense P x P methods run on the tiny model only
BASELINES = {"sgd": 0.1, "adamw": 3e-3}  # learning rates (AdamW: the better of
# 1e-3 and 3e-3 at 500 steps on the MLP, docs/precond_methods_kron.md)


def _batches(x, y, steps, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    out = []
    while len(out) < steps:
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n - batch + 1, batch):
            out.append(perm[i : i + batch])
    return out[:steps]


@torch.no_grad()
def _full_loss(model, x, y):
    return float(F.cross_entropy(model(x), y))


class Run:
    """One method training its own copy of the model; :meth:`step` runs one step."""

    def __init__(self, method, base, x, y, eval_every):
        self.x, self.y, self.eval_every = x, y, eval_every
        self.times, self.curve, self.error, self.done = [], [], None, False
        self.model = model = copy.deepcopy(base)
        if method in BASELINES:
            opt_cls = torch.optim.AdamW if method == "adamw" else torch.optim.SGD
            kwargs = {} if method == "adamw" else {"momentum": 0.9}
            self.opt = opt_cls(model.parameters(), lr=BASELINES[method], **kwargs)
            self.gm = GradientMaker(model)
        elif method in ASDL_PEERS:
            self.done = True
            try:
                import asdl
            except ImportError:
                self.error = "not installed (pip install --no-deps asdfghjkl==0.1a5)"
                return
            cls, interval, kwargs = ASDL_PEERS[method]
            config = asdl.PreconditioningConfig(
                data_size=128,
                damping=ASDL_DAMPING,
                curvature_upd_interval=interval,
                preconditioner_upd_interval=interval,
            )
            self.gm = getattr(asdl, cls)(model, config, **kwargs)
            self.done = False
            lr = PRECOND_METHODS[method.removeprefix("asdl_")].lr
            self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        else:
            spec = PRECOND_METHODS[method]
            size = sum(p.numel() for p in model.parameters())
            self.done = True
            if spec.dense and size > DENSE_LIMIT:
                self.error = f"n/a: dense {size}x{size} matrix (tiny model only)"
                return
            try:
                self.gm = make_gradient_maker(method, model, lr=spec.lr)
            except MethodUnavailableError as err:
                self.error = f"not available ({err})"
                return
            except ValueError as err:  # e.g. too big for a dense matrix
                self.error = f"n/a: {str(err).split(';')[0]}"
                return
            self.done = False
            self.opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=0.9)
        self.curve.append((0, _full_loss(model, x, y)))

    def step(self, step, idx, last):
        """Train on ``idx``; evaluate every ``eval_every`` steps; stop on failure."""
        if self.done:
            return
        model, gm, opt = self.model, self.gm, self.opt
        try:
            start = time.process_time()
            opt.zero_grad(set_to_none=True)
            out = gm.setup_model_call(model, self.x[idx])
            gm.setup_loss_call(F.cross_entropy, out, self.y[idx])
            gm.forward_and_backward()
            opt.step()
            self.times.append(time.process_time() - start)
            if step % self.eval_every == 0 or last:
                loss = _full_loss(model, self.x, self.y)
                self.curve.append((step, loss))
                if not loss < 1e3:  # diverged (or nan)
                    self.error, self.done = "diverged", True
        except Exception as err:  # noqa: BLE001 - a failing method is a table row
            traceback.print_exc()
            self.error, self.done = f"failed: {type(err).__name__}: {err}", True
            self.times = []

    def median(self):
        """Median step time after a 5-step warm-up (``None``: no step ran)."""
        if not self.times:
            return None
        return statistics.median(self.times[min(5, len(self.times) - 1) :])

    def mean(self):
        """Mean step time after the same warm-up (``None``: no step ran)."""
        if not self.times:
            return None
        return statistics.fmean(self.times[min(5, len(self.times) - 1) :])


def run_all(methods, base, x, y, batches, eval_every, chunk=10):
    """Train every method on the same batches, ``chunk`` steps of each in turn.

    Taking turns puts every method under the same load at nearly the same time, so
    the ratios to SGD hold on a shared machine whose load drifts during the run;
    ``chunk`` consecutive steps keep each method's caches as warm as in a real run.
    """
    runs = {m: Run(m, base, x, y, eval_every) for m in methods}
    for start in range(0, len(batches), chunk):
        for run in runs.values():
            for step in range(start + 1, min(len(batches), start + chunk) + 1):
                run.step(step, batches[step - 1], step == len(batches))
    return {m: (r.median(), r.mean(), r.curve, r.error) for m, r in runs.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,cnn,tiny")
    parser.add_argument("--methods", default=",".join(PRECOND_METHODS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--cnn-steps", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--full", action="store_true", help="500 steps everywhere")
    parser.add_argument("--out", default="benchmarks/precond_curves.png")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the timing this many times; x SGD is the median ratio, with "
        "its range (a shared machine's speed drifts between runs)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(1)
    steps = args.steps or (500 if args.full else 100)
    cnn_steps = args.cnn_steps or (500 if args.full else 40)
    data = load_digits()
    x, y = data.train_x, data.train_y
    methods = ["sgd", "adamw"] + [m for m in args.methods.split(",") if m]
    curves = {}
    for model_name in args.models.split(","):
        torch.manual_seed(0)
        base = MODELS[model_name]()
        n_steps = cnn_steps if model_name == "cnn" else steps
        batches = _batches(x, y, n_steps, 128, seed=1)
        rows = run_all(methods, base, x, y, batches, args.eval_every)
        # Repeats re-time every method from the same init (same curves: the
        # training is deterministic); their ratios to SGD are pooled below.
        ratios = {m: [] for m in methods}
        mean_ratios = {m: [] for m in methods}
        for repeat in range(args.repeats):
            again = (
                rows
                if repeat == 0
                else run_all(methods, base, x, y, batches, args.eval_every)
            )
            for method, (median, mean, _, _) in again.items():
                if median is not None and again["sgd"][0]:
                    ratios[method].append(median / again["sgd"][0])
                    mean_ratios[method].append(mean / again["sgd"][1])
        for method, row in rows.items():
            curves[(model_name, method)] = row[2]
        target = rows["adamw"][2][-1][1]
        params = sum(p.numel() for p in base.parameters())
        print(
            f"\n{model_name}: {params} parameters, {n_steps} steps, batch 128, "
            f"target = AdamW's loss after {n_steps} steps = {target:.4f}"
        )
        print(
            f"{'method':<16}{'step ms':>9}{'x SGD':>8}{'mean x':>8}"
            f"{'steps to target':>17}{'final loss':>12}  note"
        )
        for method, (median, _, curve, error) in rows.items():
            if median is None:
                print(
                    f"{method:<16}{'-':>9}{'-':>8}{'-':>8}{'-':>17}{'-':>12}  {error}"
                )
                continue
            pooled = sorted(ratios[method])
            ratio = statistics.median(pooled)
            mean_ratio = statistics.median(mean_ratios[method])
            spread = f" [{pooled[0]:.2f}-{pooled[-1]:.2f}]" if len(pooled) > 1 else ""
            hit = next((s for s, loss in curve if loss <= target), None)
            note = error or (
                PRECOND_METHODS[method].note
                if method in PRECOND_METHODS
                else f"ASDL 0.1a5, damping {ASDL_DAMPING:g}"
                if method in ASDL_PEERS
                else ""
            )
            print(
                f"{method:<16}{median * 1e3:>9.2f}{ratio:>8.2f}{mean_ratio:>8.2f}"
                f"{(str(hit) if hit is not None else '-'):>17}"
                f"{curve[-1][1]:>12.4f}  {note}{spread}"
            )
    _plot(curves, Path(args.out))


def _plot(curves, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    models = sorted({m for m, _ in curves})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5))
    axes = [axes] if len(models) == 1 else axes
    for ax, model in zip(axes, models, strict=True):
        for (m, method), curve in curves.items():
            if m == model and len(curve) > 1:
                steps, losses = zip(*curve, strict=True)
                ax.semilogy(
                    steps, losses, label=method, lw=2.5 if method in BASELINES else 1.2
                )
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel("training-set loss")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nloss curves: {path}")


if __name__ == "__main__":
    main()
