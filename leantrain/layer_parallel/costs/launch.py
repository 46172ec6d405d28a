"""Run one function on a few local gloo processes: the measurement tools' launcher.

:func:`run_on_gloo` spawns ``world_size`` processes on this machine, joins them in a
gloo process group (one thread each, so that every rank is one core's work), runs
``worker(rank, *args)`` in each and returns what rank 0's call returned. It is the
one launcher of the two-process timing (:func:`~.timing.measure_two_process`) and of
the benchmarks that train on several processes (``benchmarks/depth.py``,
``benchmarks/lp_phases.py``).

A failing rank does not hang the caller: the parent polls for every rank's report
and raises as soon as a process exits with an error, or when ``timeout`` passes.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import socket
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    group_timeout: float,
    worker: Callable[..., Any],
    args: tuple,
    results,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=group_timeout),
    )
    try:
        out = worker(rank, *args)
        # Every rank reports, so that one failing after rank 0 is done is seen.
        results.put((rank, out if rank == 0 else None))
    finally:
        dist.destroy_process_group()


def run_on_gloo(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 3600.0,
) -> Any:
    """``worker(rank, *args)`` on ``world_size`` spawned gloo processes; rank 0's
    return value.

    ``worker`` and ``args`` are sent to spawned processes, so they must be
    picklable (``worker`` a module-level function). Collective calls inside
    ``worker`` time out after ``timeout`` seconds as well.

    Raises:
        ValueError: ``world_size`` is not an int >= 1.
        RuntimeError: a process exits with an error, or nothing arrives within
            ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, timeout, worker, args, results),
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        done: dict[int, Any] = {}
        while len(done) < world_size:
            try:
                rank, out = results.get(timeout=1.0)
                done[rank] = out
            except queue_module.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{getattr(worker, '__name__', worker)} on {world_size} gloo "
                        f"processes failed (exit codes {[p.exitcode for p in procs]})"
                    ) from None
        return done[0]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
