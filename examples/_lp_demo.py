"""Shared runner of the layer-parallel demos (``lp_gpt.py``, ``lp_vit.py``).

Trains one model twice from the same initialisation, on the same batches:

1. serial: one process, the model's own ``ResidualStack`` (plain autograd);
2. layer-parallel: ``--procs`` gloo processes (one chunk of layers each, one thread
   each), ``LayerParallel`` applied with ``parallelize`` on a ``(dp=1, lp=P)`` mesh,
   watched by a ``Controller``; after ``--switch-at`` of the steps the stack is
   switched to serial in place (parallel-then-serial training).

The training loop is the same code on every rank: every rank feeds the same batch,
gets the (broadcast) output, computes the loss and calls ``backward()``.
Prints the final validation losses and their relative difference, and plots both
validation curves to a PNG.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leantrain.layer_parallel import (
    Controller,
    LayerParallel,
    ParallelDims,
    parallelize,
)


@dataclass
class Demo:
    """What a demo provides: model, batches, validation set, loss."""

    name: str
    build: Callable[[], torch.nn.Module]  # same initialisation on every call
    batches: Callable[[], object]  # a fresh seeded sampler with .sample()
    val: list  # fixed validation batches (x, y)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=32, help="ODE blocks N")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--procs", type=int, default=2, help="layer-parallel ranks")
    p.add_argument("--cf", type=int, default=4)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--fwd-iters", type=int, default=2)
    p.add_argument("--bwd-iters", type=int, default=1)
    p.add_argument("--check-every", type=int, default=50, help="controller K")
    p.add_argument("--switch-at", type=float, default=0.75, help="serial after this")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default=None, help="PNG path (default <name>.png)")
    return p


def _evaluate(model, demo: Demo) -> float:
    model.eval()
    with torch.no_grad():
        losses = [demo.loss(model(x), y).item() for x, y in demo.val]
    model.train()
    return sum(losses) / len(losses)


def train(demo: Demo, args, layer_parallel: bool) -> dict:
    """One training run; returns the validation curve, decisions and wall time."""
    model = demo.build()
    ctrl = None
    if layer_parallel:
        model.stack = LayerParallel(
            model.stack,
            t_final=1.0,
            levels=args.levels,
            cf=args.cf,
            fwd_iters=args.fwd_iters,
            bwd_iters=args.bwd_iters,
        )
        if dist.is_initialized():
            parallelize(model, ParallelDims(dp=1, lp=args.procs).build_mesh())
        ctrl = Controller(model, every=args.check_every, policy="serial")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    batches = demo.batches()
    switch = int(args.switch_at * args.steps)
    curve, start = [], time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, _evaluate(model, demo)))
        if step == args.steps:
            break
        if layer_parallel and step == switch and not ctrl.switched:
            model.stack.serial()  # parallel-then-serial: same module, in place
        x, y = batches.sample()
        loss = demo.loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if ctrl is not None:
            ctrl.step()
        opt.step()
    records = (
        []
        if ctrl is None
        else [(d.batch, d.action, round(d.factor, 4)) for d in ctrl.records]
    )
    return {
        "curve": curve,
        "records": records,
        "seconds": time.perf_counter() - start,
    }


def _worker(rank, world, port, demo_fn, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        result = train(demo_fn(args), args, layer_parallel=True)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def run(demo_fn: Callable[[argparse.Namespace], Demo], args) -> dict:
    """Serial run here, layer-parallel run on ``args.procs`` spawned processes."""
    torch.set_num_threads(1)
    demo = demo_fn(args)
    serial = train(demo, args, layer_parallel=False)
    if args.procs > 1:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [
            ctx.Process(
                target=_worker, args=(r, args.procs, port, demo_fn, args, queue)
            )
            for r in range(args.procs)
        ]
        for p in procs:
            p.start()
        parallel = queue.get(timeout=3600)
        for p in procs:
            p.join()
    else:
        parallel = train(demo, args, layer_parallel=True)
    s_final, p_final = serial["curve"][-1][1], parallel["curve"][-1][1]
    rel = (p_final - s_final) / s_final
    print(f"# {demo.name}: N={args.layers}, d_model={args.d_model}, {args.steps} steps")
    print(f"serial          final val loss {s_final:.4f}  ({serial['seconds']:.0f} s)")
    print(
        f"parallel->serial final val loss {p_final:.4f}  ({parallel['seconds']:.0f} s,"
        f" {args.procs} processes, switch at step {int(args.switch_at * args.steps)})"
    )
    print(f"relative difference {100 * rel:+.2f}%  (target: within 2%)")
    # One evaluation of a small validation set fluctuates from step to step; the
    # mean of the last four evaluations is the steadier comparison.
    s_tail = sum(v for _, v in serial["curve"][-4:]) / 4
    p_tail = sum(v for _, v in parallel["curve"][-4:]) / 4
    print(
        f"mean of the last 4 evaluations: serial {s_tail:.4f}, parallel->serial "
        f"{p_tail:.4f} ({100 * (p_tail - s_tail) / s_tail:+.2f}%)"
    )
    print(f"controller decisions (batch, action, factor): {parallel['records']}")
    _plot(demo.name, serial, parallel, args)
    return {"serial": serial, "parallel": parallel, "relative": rel}


def _plot(name: str, serial: dict, parallel: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, run_ in (("serial", serial), ("layer-parallel -> serial", parallel)):
        steps, losses = zip(*run_["curve"], strict=True)
        ax.plot(steps, losses, label=label)
    ax.axvline(int(args.switch_at * args.steps), color="grey", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{name}: N={args.layers} ODE blocks, {args.procs} LP ranks")
    ax.legend()
    out = args.out or f"{name}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")
