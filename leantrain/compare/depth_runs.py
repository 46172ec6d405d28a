"""The measured part of the depth comparison: a deep, narrow GPT trained serially,
pipeline-parallel and layer-parallel on 2 gloo processes (``benchmarks/depth.py``).

For each depth N of ``args.depths``, the same GPT (:func:`~.depth.deep_gpt`: ``d``,
``heads``, ``tokens``, h = 1/N; batch ``batch``, AdamW ``lr``) starts from the same
weights and trains ``args.steps`` steps on the same stdlib-text batches in each
:class:`Run`:

* serial: one process, one thread, plain autograd (rank 1 idles in a barrier);
* pipeline: ``torch.distributed.pipelining`` (:class:`~.pipeline_baseline.GPTPipeline`),
  GPipe with each micro-batch count and 1F1B with those ``>= 2``;
* layer-parallel: ``LayerParallel`` parallelized over the same 2 processes, for
  each MGRIT setting (``levels,cf,fwd_iters,bwd_iters``; ``fwd_iters`` ``serial``:
  the exact serial forward with the MGRIT adjoint).

Each run records its median step time (steps after the first), the loss of the
trained weights on a held-out batch (evaluated exactly, serially) and each rank's
peak resident memory (VmHWM, reset before the run). The layer times of every
micro-batch size, the work outside the stack and the message cost are sampled in the
same processes, between the runs, so that they see the same load; the simulators
take them (:mod:`~.depth_tables`).

Settings are ``args`` attributes (as ``benchmarks/depth.py`` parses them): ``depths``,
``d``, ``heads``, ``batch``, ``tokens``, ``steps``, ``lr``, ``micro_batches``, ``lp``,
``layer_reps``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import re
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from leantrain.compare.depth import deep_gpt
from leantrain.compare.measure import proc_status_kib, reset_peak_rss
from leantrain.compare.pipeline_baseline import GPTPipeline, check_pipeline_settings
from leantrain.data import TokenBatches, load_stdlib_text
from leantrain.layer_parallel import LayerParallel, ParallelDims, parallelize
from leantrain.layer_parallel.costs.launch import run_on_gloo
from leantrain.layer_parallel.costs.projection import MGRITSetting
from leantrain.layer_parallel.costs.simulate import LayerTimes
from leantrain.layer_parallel.costs.timing import (
    LayerSampler,
    OutsideSampler,
    measure_comm,
)
from leantrain.models import GPT, lm_loss

RANKS = 2


@dataclass(frozen=True)
class Run:
    """One training configuration of part 1."""

    kind: str  # "serial", "gpipe", "1f1b", "lp"
    micro_batches: int = 1
    lp: MGRITSetting | None = None

    @property
    def label(self) -> str:
        if self.kind == "serial":
            return "serial (1 process)"
        if self.kind == "lp":
            return f"layer-parallel {self.lp.label}"
        return f"{'GPipe' if self.kind == 'gpipe' else '1F1B'} M={self.micro_batches}"


def parse_lp(spec: str) -> MGRITSetting:
    """``"levels,cf,fwd_iters,bwd_iters"``; ``fwd_iters`` may be ``serial``."""
    return MGRITSetting.parse(spec)


def check_settings(args: argparse.Namespace) -> list[Run]:
    """Every run of part 1, after refusing settings that cannot run.

    Raises:
        ValueError: naming the depth, micro-batch count or ``--lp`` setting.
    """
    settings = [parse_lp(s) for s in args.lp]
    runs = [Run("serial")]
    for m in args.micro_batches:
        for depth in args.depths:
            check_pipeline_settings(depth, RANKS, args.batch, m, "gpipe")
        runs.append(Run("gpipe", m))
    runs += [Run("1f1b", m) for m in args.micro_batches if m >= RANKS]
    for s in settings:
        for depth in args.depths:
            if not s.valid(depth, RANKS):
                raise ValueError(
                    f"depth {depth} on {RANKS} ranks: {depth // RANKS} layers per "
                    f"rank is not a multiple of cf**(levels-1) = "
                    f"{s.cf ** (s.levels - 1)} for --lp {s.label}"
                )
        runs.append(Run("lp", lp=s))
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (one warm-up), got {args.steps}")
    return runs


def _status_mb(field: str) -> float:
    return proc_status_kib(field) / 1024


def _model(args, depth: int) -> GPT:
    return deep_gpt(depth, args.d, args.heads, args.tokens)


def _train(run: Run, model: GPT, batches, args, sample=None) -> list[float]:
    """Train ``model`` in place; returns per-step seconds (the same on all ranks).

    ``sample()`` runs after every step on the ranks the run keeps busy (rank 0
    alone for serial), so its samples see the load the steps saw."""
    rank = dist.get_rank()
    if run.kind == "serial":
        params, step = list(model.parameters()), None
    elif run.kind == "lp":
        model.stack = LayerParallel(model.stack, **run.lp.options())
        parallelize(model, ParallelDims(lp=RANKS).build_mesh())
        # foreign layers keep grad None, so AdamW leaves them alone
        params, step = list(model.parameters()), None
    else:
        pipe = GPTPipeline(model, run.kind, run.micro_batches, args.batch, args.tokens)
        params = pipe.parameters()
        step = pipe.step
    opt = torch.optim.AdamW(params, lr=args.lr)
    times = []
    for x, y in batches:
        dist.barrier()
        t0 = time.perf_counter()
        if run.kind != "serial" or rank == 0:
            opt.zero_grad(set_to_none=True)
            if run.kind in ("serial", "lp"):
                lm_loss(model(x), y).backward()
            else:
                step(x, y)
            opt.step()
        times.append(time.perf_counter() - t0)
        if sample is not None and (run.kind != "serial" or rank == 0):
            sample()
    t = torch.tensor(times)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _gather_weights(run: Run, model: GPT) -> dict[str, torch.Tensor]:
    """The whole trained model's state on every rank (owners broadcast)."""
    if run.kind == "serial":
        src = {n: 0 for n in model.state_dict()}
    elif run.kind == "lp":
        model.stack.synchronize_layers()  # embed / head are equal on every rank
        return {k: v.clone() for k, v in model.state_dict().items()}
    else:
        per = model.config.n_layer // RANKS
        src = {}
        for name in model.state_dict():
            m = re.match(r"stack\.steps\.(\d+)\.", name)
            if m:
                src[name] = int(m.group(1)) // per
            else:  # embeddings on the first stage, the head on the last
                src[name] = 0 if name.startswith(("wte", "wpe")) else RANKS - 1
    state = model.state_dict()
    for name, tensor in state.items():
        dist.broadcast(tensor, src[name])
    return {k: v.clone() for k, v in state.items()}


def _run_samplers(args, block, x, ends_model, batch, sizes) -> list:
    """Fresh layer and outside-the-stack samplers, one pair per micro-batch size."""
    out = []
    for m in sizes:
        mb = args.batch // m
        out.append(
            (
                m,
                LayerSampler(block, x[:mb], 1 / 64),
                OutsideSampler(
                    ends_model,
                    (batch[0][:mb], batch[1][:mb]),
                    lr=args.lr,
                    loss_fn=lm_loss,
                ),
            )
        )
    return out


def _measure_run(
    run: Run, args, depth: int, batches, eval_batch, samplers=None
) -> dict:
    # Freed heap back to the system, then the peak reset: VmHWM measures this run,
    # not memory that earlier runs freed but the heap kept.
    gc.collect()
    reset_peak_rss()
    base = _status_mb("VmRSS")
    model = _model(args, depth)

    def sample() -> None:
        for _, layers, ends in samplers:
            layers()
            ends()

    times = _train(run, model, batches, args, sample if samplers else None)
    peak = torch.tensor([_status_mb("VmHWM"), _status_mb("VmHWM") - base])
    peaks = [torch.zeros(2) for _ in range(RANKS)]
    dist.all_gather(peaks, peak)
    state = _gather_weights(run, model)
    ref = _model(args, depth)
    ref.load_state_dict(state)
    with torch.no_grad():
        loss = float(lm_loss(ref(eval_batch[0]), eval_batch[1]))
    del model, ref, state
    out = {
        "step": statistics.median(times[1:]),
        "loss": loss,
        "peak": [p.tolist() for p in peaks],  # per rank: (peak, rise over start)
    }
    if samplers and samplers[0][1].samples:  # the first sample is a warm-up
        for _, layers, ends in samplers:
            layers.samples, ends.samples = layers.samples[1:], ends.samples[1:]
        out["times"] = {m: list(_fields(layers.times())) for m, layers, _ in samplers}
        out["outside"] = {m: list(_fields(ends.times())) for m, _, ends in samplers}
    return out


def _fields(t) -> tuple[float, ...]:
    if isinstance(t, LayerTimes):
        return (t.forward, t.backward, t.forward_record, t.backward_params)
    return (
        t.embed,
        t.head_forward,
        t.head_backward,
        t.optimizer_layer,
        t.optimizer_ends,
    )


def _activation_bytes(block: torch.nn.Module, x: torch.Tensor, dt: float) -> float:
    """Bytes one layer saves for its backward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    xi = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(xi, dt)
    seen.pop(xi.untyped_storage().data_ptr(), None)  # the input is the state
    return float(sum(seen.values()))


def _worker(rank: int, args, runs: list[Run], on_depth=None) -> dict | None:
    """One rank of the measurement: every run at every depth, the layer and
    outside-the-stack samples between them; rank 0 returns the results."""
    text = load_stdlib_text()
    stream = TokenBatches(
        text.train, block_size=args.tokens, batch_size=args.batch, seed=0
    )
    batches = [b for _, b in zip(range(args.steps), stream, strict=False)]
    held = TokenBatches(text.val, block_size=args.tokens, batch_size=32, seed=1)
    eval_batch = next(iter(held))
    results: dict = {"comm": measure_comm(rank), "depths": {}}
    # Layer times of each micro-batch size, sampled on both processes at once
    # (busy, as in the parallel runs) between the runs, so that they see the
    # same machine load as the runs; one warm-up sample each.
    block = copy.deepcopy(_model(args, 4).stack.steps[0])
    x = torch.randn(args.batch, args.tokens, args.d)
    samplers = {
        m: LayerSampler(block, x[: args.batch // m], 1 / 64)
        for m in sorted({1, *args.micro_batches})
    }
    # The work outside the stack (embedding, head, loss, AdamW) per micro-batch
    # size, sampled the same way; AdamW on a sampling copy of 8 layers.
    ends_model = _model(args, 8)
    ends = {
        m: OutsideSampler(
            ends_model,
            (batches[0][0][: args.batch // m], batches[0][1][: args.batch // m]),
            lr=args.lr,
            loss_fn=lm_loss,
        )
        for m in samplers
    }
    for sampler in [*samplers.values(), *ends.values()]:
        sampler()
        sampler.samples.clear()
    per_round = max(1, -(-args.layer_reps // (len(args.depths) * len(runs))))
    results["act"] = _activation_bytes(block, x, 1 / 64)
    results["state_bytes"] = float(x.numel() * x.element_size())
    for depth in args.depths:
        rows = {}
        for run in runs:
            per_run = _run_samplers(args, block, x, ends_model, batches[0], samplers)
            rows[run.label] = _measure_run(
                run, args, depth, batches, eval_batch, per_run
            )
            dist.barrier()
            for sampler in [*samplers.values(), *ends.values()]:
                for _ in range(per_round):
                    sampler()
        results["depths"][depth] = rows
        results["times"] = {m: smp.times() for m, smp in samplers.items()}
        results["outside"] = {m: smp.times() for m, smp in ends.items()}
        if rank == 0 and on_depth is not None:  # as soon as it is measured
            on_depth(args, runs, results, depth)
    return results if rank == 0 else None


def measure(args, runs: list[Run], on_depth=None) -> dict:
    """Every run of ``runs`` at every depth of ``args.depths`` on :data:`RANKS` gloo
    processes; the measurements (:func:`~.depth_tables.save` writes them as JSON).

    ``on_depth(args, runs, results, depth)`` is called on rank 0 after each depth
    (the results so far), e.g. to print its table at once; it is sent to the
    spawned processes, so it must be a module-level function.
    """
    return run_on_gloo(_worker, RANKS, args, runs, on_depth, timeout=7200)
