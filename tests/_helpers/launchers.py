"""Run a function in N spawned processes that share a gloo process group (CPU only).

Every distributed test goes through :func:`run_distributed`: it picks a free TCP port,
spawns the workers with ``torch.multiprocessing``, gives each one thread (the CI
machine has two cores), and turns a failure on any rank into one clear exception in
the parent. Workers that hang are killed after ``timeout`` seconds instead of
stalling the suite.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """Return a TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    timeout: float,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        out = fn(rank, world_size, *args)
        results[rank] = ("ok", out)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    ``fn`` must be a module-level function (it is pickled) and its return value
    picklable (plain tensors, dicts, numbers).

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RuntimeError: naming every rank that failed, with its traceback, or the ranks
            that did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, results, timeout)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout + 30)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    collected = dict(results)
    manager.shutdown()
    errors = [
        f"rank {r}:\n{payload}"
        for r, (status, payload) in sorted(collected.items())
        if status == "error"
    ]
    if errors or hung:
        msg = "\n".join(errors)
        if hung:
            msg += f"\nranks {hung} did not finish within {timeout + 30:.0f} s"
        raise RuntimeError("distributed run failed:\n" + msg)
    missing = [r for r in range(world_size) if r not in collected]
    if missing:
        raise RuntimeError(f"distributed run failed: ranks {missing} returned nothing")
    return [collected[r][1] for r in range(world_size)]


def parallelize_over_all_ranks(model, timeout: float | None = None):
    """:func:`~leantrain.layer_parallel.parallelize` over a 1-D ``lp`` mesh of every
    rank (one layer chunk per rank); returns ``model``."""
    from leantrain.layer_parallel import LayerParallelConfig, ParallelDims, parallelize

    mesh = ParallelDims(lp=dist.get_world_size()).build_mesh()
    return parallelize(model, mesh, config=LayerParallelConfig(timeout=timeout))
