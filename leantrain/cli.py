"""The ``leantrain`` command.

``leantrain compare`` trains one seeded model with several optimizers (same initial
weights, same batches in the same order) and reports final losses, optimizer state
bytes per parameter and step times, each as a ratio to AdamW. See docs/compare.md.

Extending: an optimizer is one entry in :data:`OPTIMIZERS` (name -> factory), a
model/data pairing one entry in :data:`TASKS`, a subcommand one entry in
:data:`COMMANDS` (name -> (add_arguments, run)).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import leantrain
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


def _gefen(bits: int | None) -> OptimizerFactory:
    def make(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        from leantrain.optim import Gefen  # imported late: only when asked for

        return Gefen(params, lr=lr, momentum_bits=bits)

    return make


# Every optimizer keeps its own defaults (AdamW and Gefen share betas, eps and
# weight_decay=1e-2), so a row differs from AdamW only by what the optimizer is.
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "gefen8": _gefen(8),
    "gefen4": _gefen(4),
    "gefen-fp32": _gefen(None),
}
OPTIMIZER_LABELS = {
    "adamw": "AdamW",
    "gefen8": "Gefen 8-bit",
    "gefen4": "Gefen 4-bit",
    "gefen-fp32": "Gefen fp32-m",
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
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


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
        loss=lambda m, b: lm_loss(m(b[0]), b[1]),
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
            loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
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
    task: Task, name: str, steps: int, lr: float, progress: Callable[[float], None]
) -> RunResult:
    """Train a copy of ``task.model`` with optimizer ``name``; measure everything."""
    model = copy.deepcopy(task.model)  # same initial weights for every optimizer
    model.train()
    optimizer = OPTIMIZERS[name](model.parameters(), lr)
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


def _versions() -> dict[str, str]:
    import numpy

    return {
        "leantrain": leantrain.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch threads": str(torch.get_num_threads()),
    }


def run_compare(args: argparse.Namespace) -> list[RunResult]:
    """``leantrain compare``: train, print the table, write compare.{md,png,json}."""
    from tqdm import tqdm

    start = time.perf_counter()
    spec = TASKS[args.model]
    for name in ("steps", "batch_size", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(spec, name))
    if args.data is None:
        args.data = spec.default_data
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        task = spec.build(args)
        results = []
        with tqdm(total=args.steps * len(args.optimizers), file=sys.stderr) as bar:
            for name in args.optimizers:
                bar.set_description(OPTIMIZER_LABELS.get(name, name))

                def progress(loss: float) -> None:
                    bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
                    bar.update()

                results.append(train_one(task, name, args.steps, args.lr, progress))
        versions = _versions()  # records the thread count the run used
    finally:
        torch.set_num_threads(threads)  # callers (tests) keep their own setting
    wall_s = time.perf_counter() - start  # data, model, training, evaluation
    baseline = "adamw" if "adamw" in args.optimizers else args.optimizers[0]
    table = results_table(results, baseline)
    settings = (
        f"{task.description}; {args.steps} steps, batch {args.batch_size}, "
        f"lr {args.lr}, seed {args.seed}"
    )
    print(settings)
    print(table)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "leantrain " + shlex.join(args.argv)
    md = [
        "# leantrain compare",
        "",
        f"Command: `{command}`",
        "",
        settings + ". Train loss: mean of the last 10% of steps; val loss: mean "
        f"over {len(task.val_batches)} fixed validation batches. Times are means "
        "over all steps but the first (which builds the optimizer state).",
        "",
        table,
        "",
        "First step (ms, includes state set-up): "
        + ", ".join(f"{r.name} {r.first_step_ms:.1f}" for r in results)
        + f". Wall time of the whole comparison: {wall_s:.1f} s.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "",
        "![loss curves and state bytes](compare.png)",
        "",
    ]
    (out / "compare.md").write_text("\n".join(md))
    record = {
        "command": command,
        "settings": settings,
        "wall_s": wall_s,
        "baseline": baseline,
        "versions": versions,
        "results": [asdict(r) for r in results],
    }
    (out / "compare.json").write_text(json.dumps(record, indent=1))
    write_plot(results, out / "compare.png")
    print(f"wrote {out / 'compare.md'}, {out / 'compare.png'}", file=sys.stderr)
    return results


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _optimizer_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown optimizer(s) {unknown or text!r}; "
            f"allowed: {', '.join(OPTIMIZERS)}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"optimizer listed twice in {text!r}")
    return names


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``leantrain compare`` (defaults per model come from TASKS)."""
    parser.add_argument(
        "--model",
        choices=list(TASKS),
        default="gpt",
        help="gpt (default): GPT.default() on text; mlp, cnn: image classifiers",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="gpt: 'stdlib' (default) or a text file/folder; mlp/cnn: 'digits' "
        "(default) or a folder of <class>/*.png",
    )
    parser.add_argument(
        "--optimizers",
        type=_optimizer_list,
        default=["adamw", "gefen8", "gefen4"],
        help=f"comma-separated, from: {', '.join(OPTIMIZERS)} (default: "
        "adamw,gefen8,gefen4)",
    )
    for option, attr in [("--steps", "steps"), ("--batch-size", "batch_size")]:
        defaults = ", ".join(f"{k}: {getattr(v, attr)}" for k, v in TASKS.items())
        parser.add_argument(option, type=_positive_int, help=f"default {defaults}")
    lrs = ", ".join(f"{k}: {v.lr}" for k, v in TASKS.items())
    parser.add_argument("--lr", type=_positive_float, help=f"default {lrs}")
    parser.add_argument(
        "--seed", type=int, default=0, help="model init and data order (default 0)"
    )
    parser.add_argument(
        "--out", default="leantrain-compare", help="output folder (%(default)s)"
    )
    parser.add_argument(
        "--threads", type=_positive_int, help="torch threads (default: torch's)"
    )


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable]] = {
    "compare": (add_compare_arguments, run_compare),
}
COMMAND_HELP = {
    "compare": "train one model with AdamW and Gefen from the same start; "
    "print and save a table of loss, state bytes and step time",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leantrain", description="Cheaper deep-network training in PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=COMMAND_HELP.get(name)))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``leantrain`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        COMMANDS[args.command][1](args)
    except ValueError as err:  # bad data paths, block size too long, ...
        parser.exit(2, f"leantrain {args.command}: error: {err}\n")
    return 0
