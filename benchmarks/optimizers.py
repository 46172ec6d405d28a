"""Every peer optimizer of leantrain.compare on the same models, data, init and steps.

Prints one table per model, the table of ``leantrain compare --peers``
(:func:`leantrain.compare.peers.train_peer` trains each peer,
:func:`~leantrain.compare.peers.peers_table` prints it):

* **state B/param** -- bytes of every tensor in ``opt.state`` (tensor subclasses
  such as torchao's opened into their inner tensors) plus the peer's top-level
  tensors, each storage counted once, divided by the number of parameters;
* **peak step MiB** -- extra resident memory during ``step()`` (VmHWM after the
  step minus VmRSS before it; a lower bound on the temporaries), the largest over
  the steps after the first;
* **step ms** -- median ``step()`` time after the first step, and its ratio to
  AdamW (foreach) measured in the same run; **first step s** -- the first
  ``step()`` (partitions, codebooks, compilation);
* **val loss** -- validation loss after the run's steps.

The models are ``leantrain compare``'s tasks (``gpt``, ``mlp``, ``cnn``, with their
defaults) and ``gpt-25m``, a larger GPT (~25M parameters) for step timing only (a
few steps; its loss says nothing). A peer that fails to install, import or run shows
as ``failed: <reason>``. Writes one plot per model (``--plots``).

Usage::

    python benchmarks/optimizers.py                 # a few minutes
    python benchmarks/optimizers.py --full          # longer runs, every peer everywhere
    python benchmarks/optimizers.py --models mlp --peers adamw-foreach,gefen8
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from leantrain.compare.optimizers import PEERS
from leantrain.compare.peers import (
    BASELINE,
    PeerResult,
    peers_table,
    train_peer,
    write_peers_plot,
)
from leantrain.compare.report import train_each
from leantrain.compare.tasks import TASKS, gpt_task, resolve_defaults
from leantrain.models import GPTConfig

STEPS = {"gpt": 60, "mlp": 150, "cnn": 60, "gpt-25m": 8}
FULL_STEPS = {"gpt": 300, "mlp": 400, "cnn": 300, "gpt-25m": 10}
# ~25.4M parameters, batch 4, lr 1e-3: a model whose step is not all overhead.
LARGE_GPT = GPTConfig(n_layer=8, n_head=8, d_model=512)


def build_task(model: str, steps: int):
    """``(task, lr)`` of ``model``: a compare task with its defaults, or the large
    GPT."""
    base = "gpt" if model == "gpt-25m" else model
    args = argparse.Namespace(
        model=base, data=None, steps=steps, batch_size=None, lr=None, seed=0
    )
    spec = resolve_defaults(args)
    if model == "gpt-25m":
        args.batch_size, args.lr = 4, 1e-3
        return gpt_task(args, LARGE_GPT), args.lr
    return spec.build(args), args.lr


def train(task, model: str, steps: int, lr: float, args, name: str, bar):
    """One peer on one model; torchao compiles for minutes, so only with --full."""
    if name.startswith("torchao") and model != "mlp" and not args.full:
        return PeerResult(name, status="skipped: --full only (compile)")
    return train_peer(task, name, steps, lr, bar.update, weight_decay=args.weight_decay)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="longer runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated")
    parser.add_argument("--models", default="gpt,mlp,cnn,gpt-25m")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--plots", default=".", help="folder of the loss plots")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        parser.error(f"unknown peers {unknown}; known: {', '.join(PEERS)}")
    models = [m for m in args.models.split(",") if m]
    known = [*TASKS, "gpt-25m"]
    if any(m not in known for m in models):
        parser.error(f"unknown model in {models}; known: {', '.join(known)}")
    names = ([BASELINE] if BASELINE not in peers else []) + peers
    print(
        f"torch {torch.__version__}, {args.threads} threads, peers: {', '.join(names)}"
    )
    for model in models:
        steps = (FULL_STEPS if args.full else STEPS)[model]
        task, lr = build_task(model, steps)
        results = train_each(names, steps, partial(train, task, model, steps, lr, args))
        timing = " (step timing only)" if model == "gpt-25m" else ""
        print(f"\n## {task.description}: {steps} steps, lr {lr:g}{timing}\n")
        print(peers_table(results))
        if model != "gpt-25m":  # a few steps of loss say nothing
            path = Path(args.plots) / f"optimizers_{model}.png"
            write_peers_plot(results, path)
            print(f"\nloss curves: {path}")


if __name__ == "__main__":
    main()
