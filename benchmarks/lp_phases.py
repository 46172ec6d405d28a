"""Where a 2-process layer-parallel training step's time goes, phase by phase,
against what the schedule simulator charges for each phase.

The GPT of ``benchmarks/depth.py`` (d_model 128, 4 heads, batch 8, 64 tokens, fp32,
h = 1/N, AdamW 1e-3 on stdlib text) trains ``--steps`` steps per ``--lp`` setting on
2 gloo processes x 1 thread, with :func:`leantrain.layer_parallel.costs.phase_timer.
profile_phases` active; the first step is a warm-up. Between the settings both
processes sample the layer times (:class:`~leantrain.layer_parallel.costs.timing.
LayerSampler`) and the work outside the stack (:class:`~leantrain.layer_parallel.
timing.OutsideSampler`), so all of it sees the same load. For each setting and rank
the table gives per step: the calls, exclusive wall and thread-CPU ms of each phase,
and the ms the simulator charges for it (layer steps x the sampled layer time;
``outside``: the sampled outside-the-stack work), then the simulated and the
measured step.

Run: ``OMP_NUM_THREADS=1 python benchmarks/lp_phases.py`` (``--quick``: tiny sizes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from leantrain.compare.depth import deep_gpt
from leantrain.data import TokenBatches, load_stdlib_text
from leantrain.layer_parallel import (
    LayerParallel,
    ParallelDims,
    parallelize,
)
from leantrain.layer_parallel.costs.launch import run_on_gloo
from leantrain.layer_parallel.costs.phase_timer import (
    PhaseTimer,
    charged,
    profile_phases,
)
from leantrain.layer_parallel.costs.projection import MGRITSetting
from leantrain.layer_parallel.costs.timing import (
    LayerSampler,
    OutsideSampler,
    measure_comm,
)
from leantrain.models import GPT, lm_loss


def _model(args, depth: int) -> GPT:
    return deep_gpt(depth, args.d, args.heads, args.tokens)


def _run(args, setting: MGRITSetting, batches) -> tuple[PhaseTimer, list[float]]:
    model = _model(args, args.depth)
    model.stack = LayerParallel(model.stack, **setting.options())
    parallelize(model, ParallelDims(lp=dist.get_world_size()).build_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    timer, steps = PhaseTimer(), []
    with profile_phases(model.stack, timer):
        for i, (x, y) in enumerate(batches):
            dist.barrier()
            t0 = time.perf_counter()
            with timer.phase("outside"):
                opt.zero_grad(set_to_none=True)
                lm_loss(model(x), y).backward()
                opt.step()
            steps.append(time.perf_counter() - t0)
            if i == 0:
                timer.reset()
                steps.clear()
    return timer, steps


def _worker(rank: int, args) -> tuple | None:
    """One rank: every setting's phase timers, the layer and outside samples
    between them and the message cost; rank 0 returns them."""
    text = load_stdlib_text()
    stream = TokenBatches(
        text.train, block_size=args.tokens, batch_size=args.batch, seed=0
    )
    batches = [b for _, b in zip(range(args.steps + 1), stream, strict=False)]
    model = _model(args, 8)
    x = torch.randn(args.batch, args.tokens, args.d)
    samplers = [
        LayerSampler(model.stack.steps[0], x, 1 / args.depth, clock=clock)
        for clock in (time.perf_counter, time.thread_time)
    ] + [
        OutsideSampler(model, batches[0], lr=args.lr, clock=clock, loss_fn=lm_loss)
        for clock in (time.perf_counter, time.thread_time)
    ]
    for sampler in samplers:
        sampler()
        sampler.samples.clear()
    out = []
    for spec in args.lp:
        setting = MGRITSetting.parse(spec)
        timer, steps = _run(args, setting, batches)
        dist.barrier()
        for _ in range(args.samples):
            for sampler in samplers:
                sampler()
        step = torch.tensor([statistics.median(steps)])
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        got = [None, None]
        dist.all_gather_object(
            got, (dict(timer.wall), dict(timer.cpu), dict(timer.calls))
        )
        out.append((setting, step.item(), got))
    comm = measure_comm(rank)
    if rank != 0:
        return None
    return out, [s.times() for s in samplers], comm, os.getloadavg()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="timed, after a warm-up")
    parser.add_argument("--samples", type=int, default=3, help="per setting")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--lp", nargs="+", default=["2,4,1,1", "2,4,2,1", "2,4,serial,1"]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    args = parser.parse_args(argv)
    if args.quick:
        args.depth, args.d, args.heads, args.tokens, args.steps = 16, 32, 2, 16, 2
    start = time.perf_counter()
    result = run_on_gloo(_worker, 2, args, timeout=3600)
    out, (times, cpu_times, outside, cpu_outside), comm, load = result
    n, sb = args.depth, args.batch * args.tokens * args.d * 4
    print(
        f"GPT N={n}, d={args.d}, batch {args.batch}, {args.tokens} tokens, 2 gloo "
        f"processes x 1 thread; load average {load[0]:.2f} {load[1]:.2f}; layer ms "
        f"fwd {times.forward * 1e3:.2f} / fwd+graph {times.forward_record * 1e3:.2f}"
        f" / vjp {times.backward * 1e3:.2f} / vjp+params "
        f"{times.backward_params * 1e3:.2f}; outside: {outside}; message "
        f"{comm.latency * 1e6:.0f} us + {comm.bandwidth / 1e6:.0f} MB/s"
    )
    for setting, step, ranks in out:
        pred = setting.step(n, 2, times, comm, sb, outside=outside)
        bare = setting.step(n, 2, times, comm, sb)
        print(
            f"\n### {setting.label}: measured step {step * 1e3:.0f} ms, simulated "
            f"{pred * 1e3:.0f} ms (pred/meas {pred / step:.2f}; without the outside "
            f"work {bare * 1e3:.0f} ms, {bare / step:.2f})"
        )
        for rank, (wall, cpu, calls) in enumerate(ranks):
            timer = PhaseTimer()
            timer.wall.update(wall)
            timer.cpu.update(cpu)
            timer.calls.update(calls)
            sim = charged(calls, times)
            sim["outside"] = args.steps * outside.step(n // 2)
            cpu = charged(calls, cpu_times)
            cpu["outside"] = args.steps * cpu_outside.step(n // 2)
            print(f"\nrank {rank}\n")
            print(timer.table(args.steps, sim, cpu))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
