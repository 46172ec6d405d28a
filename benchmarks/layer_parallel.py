"""Layer-parallel MGRIT: accuracy vs iterations and counted work vs the cost model.

Prints two tables.

1. Relative error of the output, the input gradient and all parameter gradients of a
   stack of tiny GPT blocks (pre-LN, causal, d_model=16, 2 heads, batch 2, 8 tokens,
   float64, h = 1/N, L = 2, cf = 4) against exact serial execution, for forward
   iterations 1-4 and adjoint iterations 1-2 (skip_downcycle on, as by default).
2. Layer steps of one V-cycle on one chunk's critical path as counted by the solver,
   next to DESIGN.md's cost model W, and T(k) for k = 2 (also as the schedule simulator
   computes it with unit layer steps and free messages) with the ideal speedup N/T(k).
3. The solver's per-level counts for every cycle of one LayerParallel forward and
   adjoint (float32), with the critical path next to the model.

Run: ``python benchmarks/layer_parallel.py`` (about a minute on one CPU thread);
``--full`` adds N = 256 and d_model = 32.
"""

from __future__ import annotations

import argparse
import time

import torch

from leantrain.layer_parallel import (
    ChunkLayout,
    LayerParallel,
    LayerRNG,
    MGRITOptions,
    StepPropagator,
    mgrit_solve,
)
from leantrain.layer_parallel.costs import (
    LayerTimes,
    simulate,
    skipped_cycle_work,
    solve_time,
    vcycle_work,
)
from leantrain.models.blocks import TransformerBlock


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def accuracy_table(ns: list[int], d_model: int) -> None:
    print(f"\n## MGRIT error vs iterations (GPT blocks d={d_model}, fp64, L=2, cf=4)")
    print("| N | fwd | bwd | output rel err | input-grad rel err | param-grad rel err")
    print("|---|---|---|---|---|---")
    for n in ns:
        torch.manual_seed(0)
        blocks = [TransformerBlock(d_model, 2, causal=True) for _ in range(n)]
        stack = LayerParallel(blocks, cf=4, levels=2).double()
        params = list(stack.parameters())
        x = torch.randn(2, 8, d_model, dtype=torch.float64, requires_grad=True)
        w = torch.randn(2, 8, d_model, dtype=torch.float64)

        def run(stack=stack, params=params, x=x, w=w):
            y = stack(x)
            grads = torch.autograd.grad((y * w).sum(), [x, *params])
            return y.detach(), grads[0], torch.cat([g.flatten() for g in grads[1:]])

        ref = run(stack.serial())
        stack.parallel()
        for fwd in (1, 2, 3, 4):
            for bwd in (1, 2):
                stack.fwd_options = MGRITOptions(2, 4, fwd)
                stack.bwd_options = MGRITOptions(2, 4, bwd)
                y, gx, gp = run()
                print(
                    f"| {n} | {fwd} | {bwd} | {_rel(y, ref[0]):.2e} | "
                    f"{_rel(gx, ref[1]):.2e} | {_rel(gp, ref[2]):.2e}"
                )


def work_table() -> None:
    print("\n## Layer steps per V-cycle, one chunk's critical path (FCF, skip off)")
    print(
        "| N | P | L | cf | counted W | model W | skipped cycle | T(2) | "
        "simulated T(2) | N/T(2) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    d = 4
    for n, p, levels, cf in [
        (64, 1, 2, 4),
        (64, 4, 2, 4),
        (128, 8, 2, 4),
        (128, 2, 3, 4),
        (256, 4, 3, 4),
        (256, 16, 2, 4),
        (64, 4, 3, 2),
        (128, 4, 4, 2),
    ]:
        torch.manual_seed(0)
        lins = [torch.nn.Linear(d, d).double() for _ in range(n)]
        steps = [lambda u, dt, lin=lin: u + dt * torch.tanh(lin(u)) for lin in lins]
        layout = ChunkLayout(n, p, cf, levels)
        opts = MGRITOptions(levels, cf, 2, 1, skip_downcycle=False)
        prop = StepPropagator(steps, 1 / n, cf, LayerRNG(0, enabled=False))
        _, stats = mgrit_solve(prop, torch.randn(d, dtype=torch.float64), layout, opts)
        counted = stats.critical_path[-1]
        t2 = sum(stats.critical_path) + stats.final_work // p
        model_t2 = solve_time(layout, opts.relax, 2)
        assert t2 == model_t2, (t2, model_t2)
        # the schedule simulator (clocks per rank, free messages, unit layer steps)
        sim = simulate(
            n,
            p,
            LayerTimes(1.0, 0.0),
            levels=levels,
            cf=cf,
            fwd_iters=2,
            skip_downcycle=False,
        ).forward
        print(
            f"| {n} | {p} | {levels} | {cf} | {counted} | "
            f"{vcycle_work(layout, opts.relax):g} | {skipped_cycle_work(layout):g} | "
            f"{t2} | {sim:g} | {n / t2:.2f} |"
        )


def level_table() -> None:
    print("\n## Counted layer steps per cycle and level, forward and adjoint")
    print("(LayerParallel, N=64, P=4 chunks, L=3, cf=4, 3 fwd / 2 bwd cycles, skip on)")
    print("| solve | cycle | level 0 | level 1 | level 2 | critical path | model |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    blocks = [TransformerBlock(8, 2) for _ in range(64)]
    stack = LayerParallel(blocks, levels=3, cf=4, chunks=4, fwd_iters=3, bwd_iters=2)
    x = torch.randn(1, 4, 8, requires_grad=True)
    stack(x).sum().backward()
    layout, nu = stack.layout, stack.fwd_options.relax
    for name, stats in (
        ("forward", stack.stats.forward),
        ("adjoint", stack.stats.backward),
    ):
        cycles = zip(stats.work, stats.critical_path, strict=True)
        for k, (per_level, path) in enumerate(cycles):
            model = skipped_cycle_work(layout) if k == 0 else vcycle_work(layout, nu)
            cells = " | ".join(str(w) for w in per_level)
            print(f"| {name} | {k} | {cells} | {path} | {model:g} |")
        print(
            f"| {name} | final sweep | {stats.final_work} | | | "
            f"{stats.final_work // layout.chunks} | {layout.per_chunk(0)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="N up to 256, d_model 32")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensors: more threads only add overhead
    start = time.perf_counter()
    ns = [32, 64, 128, 256] if args.full else [32, 64, 128]
    accuracy_table(ns, 32 if args.full else 16)
    work_table()
    level_table()
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
