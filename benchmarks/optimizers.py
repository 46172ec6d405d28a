"""Every peer optimizer of leantrain.compare on the same models, data, init and steps.

Prints one table per model:

* **state B/param** -- bytes of every tensor in ``opt.state`` (tensor subclasses
  such as torchao's are opened into their inner tensors) plus the peer's top-level
  tensors (``leantrain.compare.measure.extra_state_tensors``), each storage counted
  once, divided by the number of parameters.
* **peak step MiB** -- extra resident memory during ``step()``
  (``leantrain.compare.measure.measured_step``): VmHWM is reset by writing "5" to
  ``/proc/self/clear_refs`` just before the step (after glibc's ``malloc_trim(0)``
  hands freed heap pages back), and the step's peak is VmHWM (``/proc/self/status``)
  after it minus VmRSS before it; the largest over the steps after the first (the
  first allocates the state). Freed memory the allocator still holds and reuses is
  not seen, so this is a lower bound on the temporaries.
* **step ms** -- median ``step()`` time after the first step, and its ratio to
  AdamW (foreach) measured in the same run; **first s** -- the first ``step()``
  (partitions, codebooks, compilation).
* **val loss** -- validation loss after the run's steps.

The larger GPT (~25M parameters) is for step timing only (a few steps). A peer that
fails to install, import or run shows as ``failed: <reason>``.

Usage::

    python benchmarks/optimizers.py                 # a few minutes
    python benchmarks/optimizers.py --full          # longer runs, every peer everywhere
    python benchmarks/optimizers.py --models mlp --peers adamw-foreach,gefen8
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leantrain.compare import OPTIMIZERS, PEERS, measured_step, state_nbytes

BASELINE = "adamw-foreach"


# --- models and data ---------------------------------------------------------------


@dataclass
class Task:
    """A model and its data: the same for every optimizer."""

    name: str
    build: Callable[[], nn.Module]
    train_batches: list[tuple[Tensor, Tensor]]
    val_batches: list[tuple[Tensor, Tensor]]
    loss: Callable[[nn.Module, tuple[Tensor, Tensor]], Tensor]
    lr: float
    timing_only: bool = False
    params: int = 0
    notes: list[str] = field(default_factory=list)


def _lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _cls_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def gpt_task(steps: int, *, large: bool) -> Task:
    from leantrain.data import TokenBatches, fixed_token_batches, load_stdlib_text
    from leantrain.models.gpt import GPT, GPTConfig

    corpus = load_stdlib_text()
    train, val = corpus.train.long(), corpus.val.long()
    if large:
        config = GPTConfig(n_layer=8, n_head=8, d_model=512)  # ~25.4M parameters
        batch = 4
    else:
        config = GPTConfig()
        batch = 16
    sampler = TokenBatches(
        train, block_size=config.block_size, batch_size=batch, seed=0
    )
    train_batches = [sampler.sample() for _ in range(steps)]
    val_batches = fixed_token_batches(
        val, 1 if large else 8, block_size=config.block_size, batch_size=16, seed=1
    )
    return Task(
        "gpt-25m" if large else "gpt-default",
        lambda: GPT(config),
        train_batches,
        val_batches,
        _lm_loss,
        lr=1e-3 if large else 2e-3,
        timing_only=large,
    )


def digits_task(kind: str, steps: int) -> Task:
    from leantrain.data import TensorBatches, load_digits
    from leantrain.models import cnn, mlp

    data = load_digits()
    sampler = TensorBatches(data.train_x, data.train_y, batch_size=64, seed=0)
    train_batches = [sampler.sample() for _ in range(steps)]
    build = mlp.MLP if kind == "mlp" else cnn.CNN
    return Task(
        f"{kind}-digits",
        build,
        train_batches,
        [(data.val_x, data.val_y)],
        _cls_loss,
        lr=1e-3,
    )


# --- one run -----------------------------------------------------------------------


@dataclass
class Result:
    peer: str
    status: str = "ok"
    state_bpp: float = math.nan
    peak_mib: float = math.nan
    step_ms: float = math.nan
    first_s: float = math.nan
    val_loss: float = math.nan
    losses: list[float] = field(default_factory=list)


@torch.no_grad()
def _evaluate(model: nn.Module, task: Task) -> float:
    model.eval()
    total = sum(float(task.loss(model, b)) for b in task.val_batches)
    model.train()
    return total / len(task.val_batches)


def run_one(task: Task, init: dict, peer: str, weight_decay: float) -> Result:
    """Trains a fresh copy of the task's model (same init) with one peer."""
    result = Result(peer)
    gc.collect()  # once per run: per step it costs ~0.5 s with torch's heap
    torch.manual_seed(0)
    model = task.build()
    model.load_state_dict(init)
    try:
        opt = OPTIMIZERS[peer].factory(model, task.lr, weight_decay)
        times, peaks = [], []
        for i, batch in enumerate(task.train_batches):
            opt.zero_grad(set_to_none=True)
            loss = task.loss(model, batch)
            loss.backward()
            result.losses.append(loss.item())
            elapsed, peak = measured_step(opt)
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                raise FloatingPointError(f"non-finite parameters after step {i + 1}")
            if i == 0:
                result.first_s = elapsed
            else:
                times.append(elapsed)
                if peak is not None:
                    peaks.append(peak / 2**20)
        result.step_ms = 1e3 * statistics.median(times) if times else math.nan
        result.peak_mib = max(peaks) if peaks else math.nan
        result.state_bpp = state_nbytes(opt) / task.params
        if not task.timing_only:
            result.val_loss = _evaluate(model, task)
    except Exception as error:  # a peer that fails is reported, never hidden
        reason = f"{type(error).__name__}: {error}".splitlines()[0][:90]
        result.status = f"failed: {reason}"
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    return result


def _fmt(value: float, spec: str) -> str:
    return "-" if not math.isfinite(value) else format(value, spec)


def print_table(task: Task, results: list[Result], threads: int) -> None:
    base = next((r for r in results if r.peer == BASELINE and r.status == "ok"), None)
    steps = len(task.train_batches)
    print(
        f"\n## {task.name}: {task.params / 1e6:.2f}M params, {steps} steps, "
        f"lr {task.lr:g}, {threads} threads"
        + (" (step timing only)" if task.timing_only else "")
    )
    header = (
        f"| {'optimizer':<18} | state B/param | peak step MiB | step ms | x AdamW "
        f"| first s | val loss |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in results:
        if r.status != "ok":
            print(f"| {r.peer:<18} | {r.status} |")
            continue
        ratio = r.step_ms / base.step_ms if base else math.nan
        print(
            f"| {r.peer:<18} | {_fmt(r.state_bpp, '13.3f')} | "
            f"{_fmt(r.peak_mib, '13.1f')} | {_fmt(r.step_ms, '7.2f')} | "
            f"{_fmt(ratio, '7.2f')} | {_fmt(r.first_s, '7.2f')} | "
            f"{_fmt(r.val_loss, '8.4f')} |"
        )


def plot(all_results: dict[str, list[Result]], path: Path) -> None:
    from leantrain.compare.report import pyplot

    plt = pyplot()

    shown = {k: v for k, v in all_results.items() if any(r.losses for r in v)}
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
    for ax, (name, results) in zip(axes[0], shown.items(), strict=True):
        for r in results:
            if r.status != "ok" or not r.losses:
                continue
            k = max(1, len(r.losses) // 20)  # moving average over ~5% of the run
            smooth = [
                statistics.fmean(r.losses[max(0, i - k + 1) : i + 1])
                for i in range(len(r.losses))
            ]
            ax.plot(smooth, label=r.peer, linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (moving average)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nloss curves: {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="longer runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated")
    parser.add_argument(
        "--models", default="gpt,mlp,cnn,gpt-25m", help="gpt,mlp,cnn,gpt-25m"
    )
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--png", default="optimizers.png", help="loss-curve plot")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        parser.error(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    if BASELINE not in peers:
        peers.insert(0, BASELINE)
    steps = (
        {"gpt": 300, "mlp": 400, "cnn": 300, "gpt-25m": 10}
        if args.full
        else {
            "gpt": 60,
            "mlp": 150,
            "cnn": 60,
            "gpt-25m": 8,
        }
    )
    builders = {
        "gpt": lambda: gpt_task(steps["gpt"], large=False),
        "mlp": lambda: digits_task("mlp", steps["mlp"]),
        "cnn": lambda: digits_task("cnn", steps["cnn"]),
        "gpt-25m": lambda: gpt_task(steps["gpt-25m"], large=True),
    }
    all_results: dict[str, list[Result]] = {}
    print(
        f"torch {torch.__version__}, {args.threads} threads, peers: {', '.join(peers)}"
    )
    for key in [m for m in args.models.split(",") if m]:
        if key not in builders:
            parser.error(f"unknown model {key!r}; known: {', '.join(builders)}")
        task = builders[key]()
        torch.manual_seed(0)
        model = task.build()
        task.params = sum(p.numel() for p in model.parameters())
        init = copy.deepcopy(model.state_dict())
        del model
        results = []
        for peer in peers:
            if peer.startswith("torchao") and key != "mlp" and not args.full:
                # torch.compile of every parameter shape: 1-3 min per model
                results.append(Result(peer, "skipped: --full only (compile minutes)"))
                continue
            t0 = time.perf_counter()
            results.append(run_one(task, init, peer, args.weight_decay))
            print(
                f"  {task.name} {peer}: {results[-1].status} "
                f"({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
            )
        if not task.timing_only:  # a few steps of loss say nothing
            all_results[task.name] = results
        print_table(task, results, args.threads)
    plot(all_results, Path(args.png))


if __name__ == "__main__":
    main()
