"""What ``leantrain compare`` runs: tasks, training, the table, the plot.

One seeded model is trained with several optimizers (same initial weights, same
batches in the same order); :func:`run_compare` reports final losses, optimizer
state bytes per parameter and step times, each as a ratio to AdamW. The ``--peers``
and ``--precond`` variants live in :mod:`leantrain.compare_peers` and
:mod:`leantrain.compare_precond` and reuse :data:`TASKS` and ``_report.publish``.
See docs/compare.md.

Extending: an optimizer is one entry in :data:`OPTIMIZERS` (name -> factory), a
model/data pairing one entry in :data:`TASKS`.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from leantrain._report import publish, torch_threads, train_each, versions
from leantrain.data import (
    TensorBatches,
    TokenBatches,
    fixed_token_batches,
    load_corpus,
    load_digits,
    load_image_folder,
)
from leantrain.models import CNN, GPT, MLP, lm_loss

OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]


def _gefen(bits: int | None, **options) -> OptimizerFactory:
    """Gefen with ``bits`` of momentum and ``options`` (its keyword options)."""

    def make(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        from leantrain.optim import Gefen  # imported late: only when asked for

        return Gefen(params, lr=lr, momentum_bits=bits, **options)

    return make


# Every optimizer keeps its own defaults (AdamW and Gefen share betas, eps and
# weight_decay=1e-2), so a row differs from AdamW only by what the optimizer is.
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "gefen8": _gefen(8),
    "gefen4": _gefen(4),
    "gefen-fp32": _gefen(None),
    "gefen8-factored": _gefen(8, second_moment="factored"),
    "gefen4-blocks": _gefen(4, second_moment="blocks"),
    "gefen4-noclip": _gefen(4, update_clip=None),
}
OPTIMIZER_LABELS = {
    "adamw": "AdamW",
    "gefen8": "Gefen 8-bit",
    "gefen4": "Gefen 4-bit",
    "gefen-fp32": "Gefen fp32-m",
    "gefen8-factored": "Gefen 8-bit, factored v",
    "gefen4-blocks": "Gefen 4-bit, blocks v",
    "gefen4-noclip": "Gefen 4-bit, no clip",
}


@dataclass
class Task:
    """A model and its data, ready to be trained with any optimizer.

    ``batches()`` returns a fresh seeded stream, so every optimizer sees the same
    batches in the same order; ``val_batches`` is a fixed list.
    """

    description: str
    model: nn.Module
    batches: Callable[[], Iterator[tuple[torch.Tensor, ...]]]
    val_batches: list[tuple[torch.Tensor, ...]]
    # criterion(model(batch[0]), batch[1]): split so gradient makers can record the
    # model call and the loss call apart.
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The training loss of ``model`` on one batch (inputs, targets)."""
        return self.criterion(model(batch[0]), batch[1])


@dataclass(frozen=True)
class TaskSpec:
    """How to build a task, and its default ``--steps/--batch-size/--lr``."""

    build: Callable[[argparse.Namespace], Task]
    steps: int
    batch_size: int
    lr: float
    default_data: str


def _gpt_task(args: argparse.Namespace) -> Task:
    corpus = load_corpus(args.data)
    torch.manual_seed(args.seed)
    model = GPT.default()
    T = model.config.block_size
    # Checks block_size against the corpus before any training starts.
    val = fixed_token_batches(
        corpus.val, 8, block_size=T, batch_size=args.batch_size, seed=args.seed + 1
    )
    return Task(
        description=f"GPT.default() ({model.num_params():,} params), byte-level "
        f"text '{corpus.name}' ({len(corpus.train):,} train bytes), T={T}",
        model=model,
        batches=lambda: iter(
            TokenBatches(
                corpus.train, block_size=T, batch_size=args.batch_size, seed=args.seed
            )
        ),
        val_batches=val,
        criterion=lm_loss,
    )


def _image_task(
    make_model: Callable[[tuple[int, int, int], int], nn.Module], name: str
) -> Callable[[argparse.Namespace], Task]:
    def build(args: argparse.Namespace) -> Task:
        split = load_digits() if args.data == "digits" else load_image_folder(args.data)
        torch.manual_seed(args.seed)
        c, h, w = split.image_shape
        model = make_model(split.image_shape, split.num_classes)
        n_params = sum(p.numel() for p in model.parameters())
        return Task(
            description=f"{name} ({n_params:,} params) on images '{args.data}' "
            f"({len(split.train_y)} train / {len(split.val_y)} val, {c}x{h}x{w})",
            model=model,
            batches=lambda: iter(
                TensorBatches(
                    split.train_x,
                    split.train_y,
                    batch_size=args.batch_size,
                    seed=args.seed,
                )
            ),
            val_batches=list(
                zip(split.val_x.split(512), split.val_y.split(512), strict=True)
            ),
            criterion=F.cross_entropy,
        )

    return build


TASKS: dict[str, TaskSpec] = {
    "gpt": TaskSpec(
        _gpt_task, steps=200, batch_size=16, lr=2e-3, default_data="stdlib"
    ),
    "mlp": TaskSpec(
        _image_task(lambda shape, k: MLP((math.prod(shape), 512, 512, k)), "MLP"),
        steps=300,
        batch_size=64,
        lr=1e-3,
        default_data="digits",
    ),
    "cnn": TaskSpec(
        _image_task(lambda shape, k: CNN(shape[0], k), "CNN"),
        steps=300,
        batch_size=64,
        lr=1e-3,
        default_data="digits",
    ),
}


@dataclass
class RunResult:
    """What one optimizer's run measured."""

    name: str
    train_losses: list[float] = field(default_factory=list)
    train_loss: float = float("nan")  # mean over the last 10% of steps
    val_loss: float = float("nan")
    state_bytes_per_param: float = float("nan")
    step_ms: float = float("nan")  # optimizer.step(), first step excluded
    fwd_bwd_ms: float = float("nan")  # forward + backward, first step excluded
    first_step_ms: float = float("nan")  # includes lazy state set-up


@torch.no_grad()
def evaluate(model: nn.Module, task: Task) -> float:
    """Mean loss over the task's fixed validation batches, in eval mode."""
    was_training = model.training
    model.eval()
    losses = [float(task.loss(model, batch)) for batch in task.val_batches]
    model.train(was_training)
    return sum(losses) / len(losses)


def train_one(
    task: Task,
    name: str,
    steps: int,
    lr: float,
    progress: Callable[[float], None],
    schedule: Callable[[int], float] | None = None,
) -> RunResult:
    """Train a copy of ``task.model`` with optimizer ``name``; measure everything.

    ``schedule``: a ``LambdaLR`` factor of the step (None: constant ``lr``).
    """
    model = copy.deepcopy(task.model)  # same initial weights for every optimizer
    model.train()
    optimizer = OPTIMIZERS[name](model.parameters(), lr)
    scheduler = None
    if schedule is not None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    result = RunResult(name)
    fwd_bwd, opt_step = [], []
    for batch, _ in zip(task.batches(), range(steps), strict=False):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        loss.backward()
        t1 = time.perf_counter()
        optimizer.step()
        t2 = time.perf_counter()
        if scheduler is not None:
            scheduler.step()
        fwd_bwd.append(t1 - t0)
        opt_step.append(t2 - t1)
        result.train_losses.append(loss.item())
        progress(result.train_losses[-1])
    tail = result.train_losses[-max(1, steps // 10) :]
    result.train_loss = sum(tail) / len(tail)
    result.val_loss = evaluate(model, task)
    from leantrain.optim import optimizer_state_nbytes

    n_params = sum(p.numel() for p in model.parameters())
    result.state_bytes_per_param = optimizer_state_nbytes(optimizer) / n_params
    # The first step builds the state (Gefen: partition and codebook); report it apart.
    result.first_step_ms = 1e3 * (fwd_bwd[0] + opt_step[0])
    timed = slice(1, None) if steps > 1 else slice(None)
    result.step_ms = 1e3 * sum(opt_step[timed]) / len(opt_step[timed])
    result.fwd_bwd_ms = 1e3 * sum(fwd_bwd[timed]) / len(fwd_bwd[timed])
    return result


METRICS = [  # (column title, RunResult attribute, format)
    ("train loss", "train_loss", "{:.4f}"),
    ("val loss", "val_loss", "{:.4f}"),
    ("state B/param", "state_bytes_per_param", "{:.3f}"),
    ("opt.step ms", "step_ms", "{:.2f}"),
    ("fwd+bwd ms", "fwd_bwd_ms", "{:.2f}"),
]


def results_table(results: Sequence[RunResult], baseline: str) -> str:
    """Markdown table: every metric followed by its ratio to the ``baseline`` row."""
    base = next(r for r in results if r.name == baseline)
    label = OPTIMIZER_LABELS.get(baseline, baseline)
    header = ["optimizer"]
    for title, _, _ in METRICS:
        header += [title, f"x {label}"]
    rows = [header, ["---"] + ["---:"] * (len(header) - 1)]
    for r in results:
        row = [OPTIMIZER_LABELS.get(r.name, r.name)]
        for _, attr, fmt in METRICS:
            value, ref = getattr(r, attr), getattr(base, attr)
            row += [fmt.format(value), f"{value / ref:.2f}" if ref else "n/a"]
        rows.append(row)
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def write_plot(results: Sequence[RunResult], path: Path) -> None:
    """Loss curves of every optimizer and a bar chart of state bytes/param."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        losses = torch.tensor(r.train_losses)
        k = max(1, len(losses) // 20)  # moving average: single batches are noisy
        smooth = losses.unfold(0, k, 1).mean(1) if len(losses) >= k else losses
        steps = torch.arange(len(smooth)) + k
        ax_loss.plot(steps, smooth, label=OPTIMIZER_LABELS.get(r.name, r.name))
    ax_loss.set(xlabel="step", ylabel="train loss (moving average)", title="Loss")
    ax_loss.legend()
    labels = [OPTIMIZER_LABELS.get(r.name, r.name) for r in results]
    bars = ax_mem.bar(labels, [r.state_bytes_per_param for r in results])
    ax_mem.bar_label(bars, fmt="%.2f")
    ax_mem.set(ylabel="bytes / parameter", title="Optimizer state")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def resolve_defaults(args: argparse.Namespace) -> TaskSpec:
    """Fill ``--steps/--batch-size/--lr/--data`` left unset from the model's spec."""
    spec = TASKS[args.model]
    for name in ("steps", "batch_size", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(spec, name))
    if args.data is None:
        args.data = spec.default_data
    return spec


def run_compare(args: argparse.Namespace) -> list[RunResult]:
    """``leantrain compare``: train, print the table, write compare.{md,png,json}."""
    start = time.perf_counter()
    spec = resolve_defaults(args)
    with torch_threads(args.threads):
        task = spec.build(args)

        def train(name: str, bar) -> RunResult:
            def progress(loss: float) -> None:
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
                bar.update()

            return train_one(task, name, args.steps, args.lr, progress)

        results = train_each(
            args.optimizers, args.steps, train, lambda n: OPTIMIZER_LABELS.get(n, n)
        )
        run_versions = versions()  # records the thread count the run used
    wall_s = time.perf_counter() - start  # data, model, training, evaluation
    baseline = "adamw" if "adamw" in args.optimizers else args.optimizers[0]
    publish(
        args,
        settings=f"{task.description}; {args.steps} steps, batch {args.batch_size}, "
        f"lr {args.lr}, seed {args.seed}",
        table=results_table(results, baseline),
        explanation="Train loss: mean of the last 10% of steps; val loss: mean "
        f"over {len(task.val_batches)} fixed validation batches. Times are means "
        "over all steps but the first (which builds the optimizer state).",
        after="First step (ms, includes state set-up): "
        + ", ".join(f"{r.name} {r.first_step_ms:.1f}" for r in results)
        + f". Wall time of the whole comparison: {wall_s:.1f} s.",
        results=results,
        wall_s=wall_s,
        run_versions=run_versions,
        baseline=baseline,
        plot=lambda path: write_plot(results, path),
    )
    return results
