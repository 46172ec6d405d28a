"""Per-rank Gefen state under FSDP2: single-process state / N, plus boundary blocks.

Trains the default byte-level GPT (``GPT(GPTConfig())``, ~0.8M parameters) for one
step with FSDP2 on N gloo ranks (CPU) and prints, per N, the largest per-rank
optimizer state (``optimizer_state_nbytes``), the single-process state divided by N,
the excess, and the bound the design promises: at most one duplicated block of
second moment and of momentum absmax (4 + 4 bytes) per tensor and rank. The
codebook (1 KiB) and each tensor's 0-dim ``step``/``period``/``qblock`` (20 B) are
kept whole on every rank and are not divided by N.

Run: ``python benchmarks/gefen_fsdp.py`` (N = 1, 2, 4; about a minute on 2 cores)
or ``--ranks 1 2 4 8``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leantrain.models import GPT, GPTConfig, lm_loss
from leantrain.optim import Gefen, optimizer_state_nbytes

# One global batch split over the ranks, so every N sees the same first gradient
# (float64 model: the fp32 gradient Gefen reads is then the same) and chooses the
# same periods as one process.
GLOBAL_BATCH = 16


def global_batch() -> torch.Tensor:
    return torch.randint(
        256, (GLOBAL_BATCH, 64), generator=torch.Generator().manual_seed(0)
    )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(GPTConfig()).double()
    for block in model.stack.steps:
        fully_shard(block)
    fully_shard(model)
    opt = Gefen(model.parameters())
    per = GLOBAL_BATCH // world
    x = global_batch()[rank * per : (rank + 1) * per]
    lm_loss(model(x), x).backward()
    opt.step()
    out[rank] = (optimizer_state_nbytes(opt), len(opt.state))
    dist.destroy_process_group()


def per_rank_state(world: int) -> list[tuple[int, int]]:
    """(state bytes, tensors) of every rank after one FSDP2 step on ``world`` ranks."""
    if world == 1:
        torch.manual_seed(0)
        model = GPT(GPTConfig()).double()
        opt = Gefen(model.parameters())
        x = global_batch()
        lm_loss(model(x), x).backward()
        opt.step()
        return [(optimizer_state_nbytes(opt), len(opt.state))]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        mp.start_processes(
            _worker, args=(world, _port(), out), nprocs=world, start_method="spawn"
        )
        return [out[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    single, tensors = per_rank_state(1)[0]
    # kept whole on every rank: the codebook and each tensor's 0-dim step (fp32),
    # period and qblock (int64)
    replicated = 4 * 256 + tensors * (4 + 8 + 8)
    print(f"GPT(GPTConfig()): {tensors} tensors, single-process state {single} B")
    print(
        "| N | max per-rank B | (single - replicated)/N + replicated | excess B "
        "| bound 8 B x tensors | excess / bound |"
    )
    print("|---|---|---|---|---|---|")
    for world in args.ranks:
        ranks = per_rank_state(world)
        worst = max(b for b, _ in ranks)
        share = (single - replicated) / world + replicated
        bound = 8 * tensors if world > 1 else 0
        excess = worst - share
        ratio = f"{excess / bound:.2f}" if bound else "-"
        print(f"| {world} | {worst} | {share:.0f} | {excess:.0f} | {bound} | {ratio} |")


if __name__ == "__main__":
    main()
