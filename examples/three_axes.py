"""All three axes in one run: a GPT whose stack is layer-parallel on 2 processes,
preconditioned by K-FAC, its update applied by 8-bit Gefen.

Trains the small byte-level GPT on the Python standard library's own source (no
download) with ``LayerParallel`` (MGRIT, cf 2) spread over 2 gloo processes, the
``Controller`` watching convergence, ``KfacGradientMaker`` making the gradient and
``Gefen`` (8-bit momentum) applying it; then trains the same initialisation on the
same batches serially with plain AdamW, and writes ``three_axes.png`` (training loss
of both) and prints both final losses.

Run: ``python examples/three_axes.py`` (about 4 minutes on 2 cores: the layer-parallel
run takes about 2 s a step there); ``--help``.

The loop every rank runs::

    model.stack = LayerParallel(model.stack, cf=2)
    parallelize(model, ParallelDims(lp=2).build_mesh())   # one chunk per rank
    maker = make_gradient_maker("kfac", model, config={"ignore_modules": ["wpe"]},
                                lr=LR)                   # the KL clip's learning rate
    opt, ctrl = Gefen(model.parameters(), lr=LR), Controller(model, every=25)
    for x, y in batches:                      # the same batch on every rank
        out = maker.setup_model_call(model, x)
        maker.setup_loss_call(lm_loss, out, y)
        maker.forward_and_backward()          # K-FAC through the adjoint MGRIT
        opt.step(); opt.zero_grad(); ctrl.step()
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leantrain.data import TokenBatches, load_stdlib_text
from leantrain.layer_parallel import (
    Controller,
    LayerParallel,
    ParallelDims,
    parallelize,
)
from leantrain.models import GPT, GPTConfig, lm_loss
from leantrain.optim import Gefen
from leantrain.precond import GradientMaker
from leantrain.precond.registry import make_gradient_maker

BLOCK, BATCH = 32, 8


def build(args) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        block_size=BLOCK,
        n_layer=args.layers,
        n_head=2,
        d_model=args.d_model,
        t_final=1.0,  # h = 1/N: the regime in which MGRIT converges
    )
    return GPT(config)


def train(args, *, three_axes: bool, show: bool) -> list[float]:
    """Training losses of ``args.steps`` steps (three axes, or serial AdamW)."""
    from tqdm import tqdm

    model = build(args)
    if three_axes:
        model.stack = LayerParallel(model.stack, cf=2)
        parallelize(model, ParallelDims(lp=dist.get_world_size()).build_mesh())
        maker = make_gradient_maker(
            "kfac",
            model,
            config={"damping": 1e-2, "ignore_modules": ["wpe"]},
            lr=args.lr,
        )
        opt = Gefen(model.parameters(), lr=args.lr)
        ctrl = Controller(model, every=25)
    else:
        maker = GradientMaker(model)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        ctrl = None
    batches = TokenBatches(
        load_stdlib_text().train, block_size=BLOCK, batch_size=BATCH, seed=1
    )
    losses = []
    label = "K-FAC + Gefen, layer-parallel x2" if three_axes else "AdamW, serial"
    bar = tqdm(
        zip(range(args.steps), batches, strict=False),
        total=args.steps,
        disable=not show,
    )
    bar.set_description(label)
    for _, (x, y) in bar:
        out = maker.setup_model_call(model, x)
        maker.setup_loss_call(lm_loss, out, y)
        _, loss = maker.forward_and_backward()
        opt.step()
        opt.zero_grad()
        if ctrl is not None:
            ctrl.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    try:
        losses = train(args, three_axes=True, show=rank == 0)
        if rank == 0:
            queue.put(losses)
    finally:
        dist.destroy_process_group()


def three_axes_losses(args) -> list[float]:
    """Run the three-axes training on 2 spawned gloo processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, 2, port, args, queue)) for r in range(2)
    ]
    for p in procs:
        p.start()
    losses = queue.get(timeout=1800)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a worker exited with code {p.exitcode}")
    return losses


def plot(three: list[float], serial: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(serial, label="AdamW, serial")
    ax.plot(three, label="K-FAC + Gefen 8-bit, layer-parallel on 2 processes")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", default="three_axes.png")
    args = p.parse_args(argv)
    three = three_axes_losses(args)
    serial = train(args, three_axes=False, show=True)
    plot(three, serial, args.out)
    tail = max(1, args.steps // 10)
    a, b = sum(three[-tail:]) / tail, sum(serial[-tail:]) / tail
    print(
        f"mean training loss of the last {tail} steps: three axes {a:.4f}, "
        f"serial AdamW {b:.4f} (ratio {a / b:.3f}); plot: {args.out}"
    )
    return {"three_axes": three, "serial": serial}


if __name__ == "__main__":
    main()
