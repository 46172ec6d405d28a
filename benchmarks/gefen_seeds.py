"""Gefen's validation loss against AdamW over several seeds, with a noise control.

One run of ``leantrain compare`` compares two single trajectories. On the default GPT
run (200 steps, lr 2e-3) the validation loss at the last step depends on when the
model leaves its early plateau (train loss ~2.9), and that moment moves with any
perturbation of the trajectory: AdamW itself with ``eps=1e-7`` instead of 1e-8
scores 0.91x-1.015x of AdamW over seeds 0-7, with 3% less learning rate up to 1.06x.
A 1% claim needs more than one seed, and a yardstick for what "the same optimizer"
scores.

For each seed (initialisation and data order), every variant trains from the same
initial weights on the same batches as AdamW (``leantrain.compare``'s tasks and
its training loop, ``train_one``), and
its validation loss is divided by AdamW's of that seed. The table prints each
seed's ratio, then the geometric mean over seeds with a 95% interval (t
distribution on the log ratios), and the same summary of the training loss (mean of
the last 10% of steps) over AdamW's: a variant that fits faster and generalizes
worse shows there. The controls are AdamW variants that should not
matter: ``adamw-eps`` (eps 1e-7) and ``adamw-lr`` (lr x 0.97). Where a control's
interval is wider than 1%, one run cannot resolve a 1% difference either.

Run: ``python benchmarks/gefen_seeds.py --model gpt --seeds 0-7`` (2 threads: about
45 s per GPT seed for AdamW and the four default variants, 6 minutes in all; the MLP
and CNN take seconds per seed). ``--plot PATH`` also draws every seed's ratio and the
summaries as a PNG. ``--variants`` takes ``adamw-eps``, ``adamw-lr`` and
``benchmarks/gefen_quality.py``'s ``BITS:PARTITION`` specs (``8:auto`` is Gefen
8-bit), and ``probe:SPEC`` for ``benchmarks/second_moment_probes.py``'s AdamW with a
swapped second moment. Results: docs/results.md, "Quality, short runs over
seeds", and docs/notebook/2026-12-03-gefen-short-runs-over-seeds.md.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

# Sibling benchmarks: importable as run (python puts benchmarks/ first on the path).
from gefen_quality import make_optimizer
from second_moment_probes import ProbeAdamW, parse_probe

from leantrain import compare
from leantrain.cli import build_parser
from leantrain.compare.report import progress_bar
from leantrain.compare.stats import ratio_interval as summary

DEFAULT_VARIANTS = "adamw-eps,adamw-lr,8:auto,4:auto"


def control(spec: str, params, lr: float) -> torch.optim.Optimizer:
    """An AdamW that should score like AdamW (the noise yardstick)."""
    if spec == "adamw-eps":
        return torch.optim.AdamW(params, lr=lr, eps=1e-7)
    if spec == "adamw-lr":
        return torch.optim.AdamW(params, lr=0.97 * lr)
    raise ValueError(f"unknown control {spec!r}; known: adamw-eps, adamw-lr")


def register(spec: str) -> str:
    """Add ``spec`` to ``compare.OPTIMIZERS`` (under its own name) and return it.

    The variants keep their own weight decay (the controls AdamW's default, the
    Gefen specs gefen_quality's), so the registry's is not passed on.
    """
    if spec.startswith("adamw-"):
        control(spec, [torch.zeros(1, requires_grad=True)], 1e-3)  # validate now

        def factory(model, lr, _weight_decay):
            return control(spec, model.parameters(), lr)

    elif spec.startswith("probe:"):
        probe = spec.removeprefix("probe:")
        parse_probe(probe)  # validate now

        def factory(model, lr, _weight_decay):
            return ProbeAdamW(model.parameters(), lr, probe)

    else:
        make_optimizer(spec, torch.nn.Linear(1, 1), 1e-3)  # validate now

        def factory(model, lr, _weight_decay):
            return make_optimizer(spec, model, lr)

    compare.OPTIMIZERS[spec] = compare.OptimizerEntry(factory, spec, "gefen_seeds")
    return spec


def parse_seeds(text: str) -> list[int]:
    """``"0-7"`` or ``"0,3,5"`` -> a list of seeds."""
    if "-" in text:
        low, high = (int(x) for x in text.split("-"))
        if high < low:
            raise ValueError(f"--seeds {text!r}: the range is empty")
        return list(range(low, high + 1))
    return [int(x) for x in text.split(",")]


def _study(args: argparse.Namespace, seeds: list[int], variants: list[str]):
    """Train AdamW and every variant for each seed; the ratios to AdamW of the
    validation loss (per seed, for the table) and of the training loss (mean of
    the last 10% of steps, for the summary)."""
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    train_ratios: dict[str, list[float]] = {v: [] for v in variants}
    rows = []
    with progress_bar(len(seeds), "seeds", unit="seed") as bar:
        for seed in seeds:
            cli = ["compare", "--model", args.model, "--seed", str(seed)]
            cli += ["--steps", str(args.steps)] if args.steps else []
            run = build_parser().parse_args(cli)
            task = compare.resolve_defaults(run).build(run)
            results = {}
            for name in ["adamw", *variants]:
                results[name] = compare.train_one(task, name, run.steps, run.lr, _quiet)
            base = results["adamw"]
            seed_ratios = [results[v].val_loss / base.val_loss for v in variants]
            for v, ratio in zip(variants, seed_ratios, strict=True):
                ratios[v].append(ratio)
                train_ratios[v].append(results[v].train_loss / base.train_loss)
            rows.append((seed, base.val_loss, seed_ratios))
            bar.update()
    return run, rows, ratios, train_ratios


def _quiet(_loss: float) -> None:
    """compare.train_one's progress callback, unused here (the bar counts seeds)."""


def write_plot(model: str, rows, variants: list[str], path: Path) -> None:
    """Every seed's ratio (dots) and the geometric mean with its 95% interval (a
    bar) per variant, on a log axis, with 1.0 (AdamW) marked."""
    from matplotlib.ticker import FormatStrFormatter

    from leantrain.compare.report import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(variants), 4))
    for x, v in enumerate(variants):
        ratios = [rs[variants.index(v)] for _, _, rs in rows]
        finite = [r for r in ratios if math.isfinite(r) and r > 0]
        ax.scatter([x] * len(finite), finite, s=14, alpha=0.6, color="tab:blue")
        mean, low, high = summary(ratios)
        if math.isfinite(mean):
            yerr = [[mean - low], [high - mean]] if math.isfinite(low) else None
            ax.errorbar(x + 0.15, mean, yerr=yerr, fmt="o", color="black", capsize=4)
    ax.axhline(1.0, color="tab:red", linewidth=1, label="AdamW")
    ax.set_yscale("log")
    plain = FormatStrFormatter("%.2f")  # 1.05, not 1.05e0
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xticks(range(len(variants)), variants, rotation=20)
    ax.set(
        ylabel="validation loss / AdamW's (same seed)",
        title=f"{model}: {len(rows)} seeds (dots), geo-mean and 95% interval",
    )
    ax.legend(loc="best")  # away from the dots
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=sorted(compare.TASKS))
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--steps", type=int, default=None, help="default: compare's")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    args = parser.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    # The variants join compare's registry and the thread count is set for this
    # run only: both are put back, so a caller (a test) sees no change.
    saved, threads = dict(compare.OPTIMIZERS), torch.get_num_threads()
    try:
        variants = [register(v) for v in args.variants.split(",") if v]
        torch.set_num_threads(args.threads)
        run, rows, ratios, train_ratios = _study(args, seeds, variants)
    finally:
        compare.OPTIMIZERS.clear()
        compare.OPTIMIZERS.update(saved)
        torch.set_num_threads(threads)
    print(
        f"\n{args.model}: {run.steps} steps, lr {run.lr}, batch {run.batch_size}; "
        "validation loss as a ratio to AdamW of the same seed"
    )
    print(f"{'seed':>5s} {'AdamW':>8s} " + " ".join(f"{v:>10s}" for v in variants))
    for seed, base, rs in rows:
        print(f"{seed:5d} {base:8.4f} " + " ".join(f"{r:10.3f}" for r in rs))
    print(
        f"\n{'variant':>10s} {'geo-mean':>9s} {'95% interval':>17s}"
        f"   {'train loss':>10s} {'95% interval':>17s}"
    )
    for v in variants:
        mean, low, high = summary(ratios[v])
        t_mean, t_low, t_high = summary(train_ratios[v])
        print(
            f"{v:>10s} {mean:9.3f}   [{low:.3f}, {high:.3f}]"
            f"   {t_mean:10.3f}   [{t_low:.3f}, {t_high:.3f}]"
        )
    if args.plot is not None:
        write_plot(args.model, rows, variants, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
