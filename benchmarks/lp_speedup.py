"""Layer-parallel speedup: 2 processes x 1 thread vs 1 process x 1 thread, and the
simulator's prediction of it; then a simulator table for N = 128 BERT-size blocks.

Part 1 (measured). A stack of N = 64 pre-LN causal GPT blocks (d_model 256, 4 heads,
batch 8, 64 tokens, fp32) trained one step forward+backward:

* serial: one process, one thread, plain autograd (``LayerParallel.serial()``);
* layer-parallel: two gloo processes, one thread each, L = 2, cf = 4, one forward
  iteration with the skipped down-cycle, one adjoint iteration (F-C relaxation).

Both run inside the same two spawned processes, interleaved round by round (a
parallel step on both, then a serial step on rank 0 while rank 1 waits, then layer
samples on both), so all of them see the same machine load; each time is the median
of ``--repeats`` rounds after one warm-up. The per-layer step times (forward without /
with graph, VJP without / with parameters, measured while both processes are busy)
and the message cost (latency from 8-byte ping-pongs, bandwidth from 4 MB ones) are
fed to ``leantrain.layer_parallel.costs.simulate`` to predict the 2-process step.

Part 2 (projected). ``simulate`` for N = 128 BERT-base blocks (d 768, 12 heads, 128
tokens, batch 1, fp32; layer times measured here on one thread), P = 2..64, L = 2-3,
cf = 2-8, forward 1 cycle (skip) and adjoint 1 cycle (plus rows for the serial forward
with an MGRIT adjoint), under two communication models:
the gloo loopback measured in part 1, and a GPU interconnect (10 us, 25 GB/s).

Run: ``python benchmarks/lp_speedup.py`` (a few minutes on 2 quiet cores);
``--quick`` uses N = 16 and d = 64 for a smoke test.
"""

from __future__ import annotations

import argparse
import time

import torch

from leantrain.compare.depth import gpt_blocks
from leantrain.layer_parallel.costs.simulate import CommModel, LayerTimes, simulate
from leantrain.layer_parallel.costs.timing import (
    StackSpec,
    layer_times,
    measure_two_process,
)
from leantrain.models.blocks import TransformerBlock


def measured(args) -> CommModel:
    n, d = args.n, args.d
    print(
        f"\n## Measured: N={n} GPT blocks d={d}, {args.heads} heads, batch "
        f"{args.batch}, {args.tokens} tokens, fp32, L=2, cf=4, 1 fwd (skip) / 1 bwd"
    )
    spec = StackSpec(
        n_layers=n,
        d_model=d,
        n_head=args.heads,
        batch=args.batch,
        tokens=args.tokens,
        repeats=args.repeats,
        layer_reps=args.layer_reps,
    )
    timing = measure_two_process(spec, gpt_blocks, timeout=7200)
    par, serial, lt, comm = timing.parallel, timing.serial, timing.layers, timing.comm
    lat, bandwidth, nbytes = comm.latency, comm.bandwidth, spec.state_bytes
    pred = simulate(
        n, 2, lt, cf=4, fwd_iters=1, bwd_iters=1, comm=comm, state_bytes=nbytes
    )
    print("| quantity | value |\n|---|---|")
    rows = [
        (
            "layer fwd / fwd+graph / vjp / vjp+params, in the 2-process run (ms)",
            _ms(lt),
        ),
        (
            "message latency (us) / bandwidth (MB/s)",
            f"{lat * 1e6:.0f} / {bandwidth / 1e6:.0f}",
        ),
        ("serial step, 1 process x 1 thread (s, median)", f"{serial:.3f}"),
        ("layer-parallel step, 2 processes x 1 thread (s, median)", f"{par:.3f}"),
        ("measured speedup", f"{serial / par:.2f}x"),
        ("simulated 2-process step (s)", f"{pred.step:.3f}"),
        ("simulated / measured 2-process step", f"{pred.step / par:.2f}"),
        ("simulated speedup (serial = N x layer times)", f"{pred.speedup:.2f}x"),
        ("ideal model speedup (unit layers, free comm)", f"{_ideal(n):.2f}x"),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |")
    return comm


def _ideal(n: int) -> float:
    return simulate(n, 2, LayerTimes(1.0, 1.0), cf=4, fwd_iters=1).speedup


def _ms(t: LayerTimes) -> str:
    parts = (t.forward, t.forward_record, t.backward, t.backward_params)
    return " / ".join(f"{v * 1e3:.1f}" for v in parts)


def table(gloo: CommModel, args) -> None:
    d, heads, tokens = (768, 12, 128) if not args.quick else (64, 4, 16)
    torch.manual_seed(0)
    block = TransformerBlock(d, heads)
    x = torch.randn(1, tokens, d)
    lt = layer_times(block, x, 1 / 128, args.layer_reps)
    nbytes = x.numel() * 4
    print(
        f"\n## Simulated speedup over serial, N=128 BERT blocks (d={d}, {heads} "
        f"heads, {tokens} tokens, batch 1; layer ms {_ms(lt)}), 1 fwd / 1 bwd cycle"
    )
    loopback = f"{gloo.latency * 1e6:.0f} us, {gloo.bandwidth / 1e6:.0f} MB/s"
    models = {
        f"gloo loopback as measured ({loopback})": gloo,
        "GPU interconnect (10 us, 25 GB/s)": CommModel(1e-5, 25e9),
    }
    ps = [2, 4, 8, 16, 32, 64]
    for name, comm in models.items():
        print(
            f"\n### {name}  (**bold**: layer-parallel beats serial; -: N/P not a "
            "multiple of cf^(L-1))"
        )
        print("| L | cf | " + " | ".join(f"P={p}" for p in ps) + " |")
        print("|---|---|" + "---|" * len(ps))
        rows = [(lv, cf, "mgrit") for lv in (2, 3) for cf in (2, 4, 8)]
        rows += [(lv, 4, "serial") for lv in (2, 3)]  # serial fwd, MGRIT adjoint
        for levels, cf, forward_solver in rows:
            cells = []
            for p in ps:
                if (128 // p) % cf ** (levels - 1):
                    cells.append("-")
                    continue
                s = simulate(
                    128,
                    p,
                    lt,
                    levels=levels,
                    cf=cf,
                    fwd_iters=1,
                    bwd_iters=1,
                    comm=comm,
                    state_bytes=nbytes,
                    forward_solver=forward_solver,
                ).speedup
                cells.append(f"**{s:.2f}**" if s > 1 else f"{s:.2f}")
            label = f"{cf}" if forward_solver == "mgrit" else f"{cf}, serial fwd"
            print(f"| {levels} | {label} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layer-reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="N=16, d=64 smoke test")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.n, args.d, args.batch, args.tokens, args.repeats = 16, 64, 2, 16, 3
    start = time.perf_counter()
    if args.table_only:
        comm = CommModel(latency=5e-5, bandwidth=1e9)
    else:
        comm = measured(args)
    table(comm, args)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
