"""Independent runs of ``leantrain compare``'s axes, in separate processes.

A :class:`Job` is one independent run (one optimizer and seed, one preconditioning
method, the depth axis' accuracy check): a module-level function and its arguments,
so that it can be sent to a spawned worker. :func:`run_jobs` runs the exclusive jobs
first, one at a time in this process (they start their own processes and need every
core, e.g. the two-process layer-parallel timing), then the others on ``workers``
processes with one torch thread each, longest first. Every job ticks one progress
bar through a queue (a training run once per step), and records the CPU time it
used and the 1-minute load average when it started and when it ended
(:class:`RunStats`), so that a slow run can be told from a loaded machine.
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import queue as queue_module
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from leantrain.compare.report import progress_bar

_TICKS = None  # the worker's queue to the progress bar (set by _init_worker)


@dataclass(frozen=True)
class Job:
    """One independent run: ``fn(*args, progress=tick)`` returns its result.

    ``ticks``: how often ``fn`` calls ``progress`` (a run's steps); ``cost``: its
    expected seconds, for the order (longest first); ``exclusive``: run alone in the
    main process (it uses every core itself).
    """

    key: Hashable
    label: str
    fn: Callable[..., Any]
    args: tuple = ()
    ticks: int = 1
    cost: float = 1.0
    exclusive: bool = False
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunStats:
    """What a job cost and how busy the machine was while it ran.

    ``cpu_s``: CPU seconds of the process that ran it (an exclusive job's own child
    processes not counted); ``load_before``, ``load_after``: the 1-minute load
    average at its start and its end (NaN where the platform has none);
    ``started``, ``ended``: ``time.time()`` then.
    """

    cpu_s: float
    load_before: float
    load_after: float
    started: float
    ended: float

    @property
    def under_load(self) -> bool:
        """The load average passed :func:`load_limit` at the start or the end."""
        return any(v > load_limit() for v in (self.load_before, self.load_after))


def load_average() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


def load_limit() -> int:
    """The load average above which a run counts as measured under load: the CPU
    cores of the machine (more runnable tasks than cores: some of them waited)."""
    return os.cpu_count() or 1


def runs_description(jobs: Sequence[Job], workers: int) -> str:
    """``"14 runs on 2 processes"``: the count of the progress bar and the report."""
    return f"{len(jobs)} runs on {workers} process" + ("es" if workers > 1 else "")


def _measure(job: Job, progress: Callable[[], None]) -> tuple[Any, RunStats]:
    started, before, cpu = time.time(), load_average(), time.process_time()
    result = job.fn(*job.args, progress=progress, **job.kwargs)
    cpu = time.process_time() - cpu
    return result, RunStats(cpu, before, load_average(), started, time.time())


def _init_worker(ticks, threads: int) -> None:
    global _TICKS
    _TICKS = ticks
    torch.set_num_threads(threads)


def _tick() -> None:
    _TICKS.put(1)


def _run_in_worker(job: Job) -> tuple[Any, RunStats]:
    return _measure(job, _tick)


def run_jobs(jobs: Sequence[Job], workers: int, threads: int = 1) -> tuple[dict, dict]:
    """Run every job; returns ``{job.key: result}`` and ``{job.key: RunStats}``.

    The progress bar counts the jobs' ticks (training steps; a job that is not a
    training run ticks once) and names the runs as the report does
    (:func:`runs_description`).

    ``workers == 1`` runs everything in this process (no spawn cost; the tests use
    it). An exception in a job is raised here, naming the job.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    keys = [j.key for j in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"job keys must be unique, got {keys}")
    results: dict = {}
    stats: dict = {}
    total = sum(j.ticks for j in jobs)
    with progress_bar(total, f"steps of {runs_description(jobs, workers)}") as bar:
        pooled = sorted((j for j in jobs if not j.exclusive), key=lambda j: -j.cost)
        local = [j for j in jobs if j.exclusive]
        if workers == 1:
            local += pooled
            pooled = []
        for job in local:
            bar.set_postfix_str(job.label)
            before = bar.n
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                results[job.key], stats[job.key] = _measure(job, bar.update)
            except Exception as err:
                raise RuntimeError(f"compare run {job.label!r} failed: {err}") from err
            finally:
                torch.set_num_threads(previous)
            bar.update(max(0, before + job.ticks - bar.n))  # a job may tick less
        if pooled:
            bar.set_postfix_str("")
            for key, (result, run_stats) in _run_pool(
                pooled, workers, threads, bar
            ).items():
                results[key], stats[key] = result, run_stats
    return results, stats


def _run_pool(jobs: Sequence[Job], workers: int, threads: int, bar) -> dict:
    ctx = multiprocessing.get_context("spawn")  # no fork of a threaded parent
    ticks = ctx.Queue()
    results = {}
    start = bar.n
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=workers,
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(ticks, threads),
    ) as pool:
        futures = {pool.submit(_run_in_worker, job): job for job in jobs}
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=0.2)
            _drain(ticks, bar)
            for future in done:
                job = futures[future]
                try:
                    results[job.key] = future.result()
                except Exception as err:
                    raise RuntimeError(
                        f"compare run {job.label!r} failed: {err}"
                    ) from err
    _drain(ticks, bar)
    bar.update(max(0, start + sum(j.ticks for j in jobs) - bar.n))
    return results


def _drain(ticks, bar) -> None:
    n = 0
    while True:
        try:
            n += ticks.get_nowait()
        except queue_module.Empty:
            break
    if n:
        bar.update(n)
