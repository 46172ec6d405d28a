"""The memory axis of ``leantrain compare``: AdamW against Gefen 8-bit and 4-bit.

Every optimizer trains a small GPT (d = 256, one block, context 32) on the embedded
text with a linear warm-up and a cosine decay, once per seed; within a seed every
optimizer starts from the same weights and sees the same batches, so each seed
gives one *paired* ratio: a Gefen run's validation loss over AdamW's. The
run-to-run spread is the spread of these ratios over the seeds, measured in the same
comparison. A Gefen row's verdict is worded from the geometric mean of its ratios
and their 95 % interval (Student t on the log ratios,
:func:`leantrain.compare.stats.ratio_interval`): "within run-to-run noise" when the
interval holds 1, otherwise "x % worse (or better), outside it". The model and the
learning rate's warm-up and decay are those of the long-run benchmark
(``benchmarks/gefen_long.py``), at a third of its length: by then the loss has
left its first plateau and the paired ratios of one setting stay within about 1 %
of each other, so three seeds resolve a gap of about 1.5 %. These are the CPU
sizes; on CUDA the model is GPT-2-small-sized (``compare.devices.DEVICE_SIZES``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch

from leantrain.compare.jobs import Job
from leantrain.compare.lr import warmup_cosine
from leantrain.compare.optimizers import label
from leantrain.compare.report import fmt, mark_under_load, markdown_table
from leantrain.compare.stats import ratio_interval
from leantrain.compare.tasks import Task
from leantrain.compare.training import RunResult, train_one
from leantrain.data import TokenBatches, fixed_token_batches, load_corpus
from leantrain.models import GPT, GPTConfig, lm_loss

_TASKS: dict = {}  # per process: the task of each (config, seed)


@dataclass(frozen=True)
class MemoryConfig:
    """What the memory axis trains: a GPT of ``d_model`` x ``n_layer`` blocks on
    ``block_size``-byte windows, ``steps`` of ``batch_size`` sequences."""

    optimizers: tuple[str, ...] = ("adamw", "gefen8", "gefen4")
    seeds: tuple[int, ...] = (0, 1, 2)  # three: two resolve only gaps of ~5 %
    d_model: int = 256  # the long-run benchmark's model: Gefen's matrices factor
    n_layer: int = 1
    n_head: int = 8
    block_size: int = 32
    # 700 steps leave the first plateau (AdamW's training loss about 2.5 around
    # steps 100-150, 2.06 at the end) and keep nine runs on two cores within budget.
    steps: int = 700
    warmup: int = 35  # 5 % of the steps, then cosine to 10 % of lr
    batch_size: int = 8
    lr: float = 1e-3
    val_batches: int = 16  # of 16 windows each
    data: str = "stdlib"
    seconds_per_step: float = 0.02  # a rough cost, to run the longest first
    device: str = "cpu"  # "cuda": the sizes of compare.devices.DEVICE_SIZES


DEFAULT = MemoryConfig()


def seeded_gpt(config, seed: int) -> GPT:
    """The GPT of ``config`` (anything with ``d_model``, ``n_layer``, ``n_head`` and
    ``block_size``) initialised after ``torch.manual_seed(seed)``: the model of the
    memory axis and of ``benchmarks/gefen_long.py``."""
    torch.manual_seed(seed)
    return GPT(
        GPTConfig(
            d_model=config.d_model,
            n_layer=config.n_layer,
            n_head=config.n_head,
            block_size=config.block_size,
        )
    )


def _task(config: MemoryConfig, seed: int) -> Task:
    key = (config, seed)
    if key not in _TASKS:  # the corpus is read and the model built once per process
        corpus = load_corpus(config.data)
        model = seeded_gpt(config, seed)
        val = fixed_token_batches(
            corpus.val,
            config.val_batches,
            block_size=config.block_size,
            batch_size=16,
            seed=1234,
        )
        task = Task(
            description=f"GPT d_model {config.d_model}, {config.n_layer} block(s), "
            f"context {config.block_size} ({model.num_params():,} params), "
            f"byte-level text '{corpus.name}' ({len(corpus.train):,} train bytes)",
            model=model,
            batches=lambda: iter(
                TokenBatches(
                    corpus.train,
                    block_size=config.block_size,
                    batch_size=config.batch_size,
                    seed=seed,
                )
            ),
            val_batches=val,
            criterion=lm_loss,
        )
        _TASKS[key] = task.to(config.device)
    return _TASKS[key]


def train_memory_run(
    config: MemoryConfig, name: str, seed: int, *, progress: Callable[[], None]
) -> RunResult:
    """One optimizer, one seed (a job of :func:`jobs`)."""
    task = _task(config, seed)
    return train_one(
        task,
        name,
        config.steps,
        config.lr,
        lambda _loss: progress(),
        lr_factor=warmup_cosine(config.warmup, config.steps),
    )


def jobs(config: MemoryConfig) -> list[Job]:
    """One job per optimizer and seed."""
    if "adamw" not in config.optimizers:
        raise ValueError(
            f"the memory axis compares with AdamW: optimizers must include 'adamw', "
            f"got {config.optimizers}"
        )
    if len(config.seeds) < 2:
        raise ValueError(
            f"the run-to-run spread needs at least two seeds, got {config.seeds}"
        )
    return [
        Job(
            key=("memory", name, seed),
            label=f"{label(name)} seed {seed}",
            fn=train_memory_run,
            args=(config, name, seed),
            ticks=config.steps,
            cost=config.steps * config.seconds_per_step,
        )
        for name in config.optimizers
        for seed in config.seeds
    ]


@dataclass
class MemoryRow:
    """One optimizer over the seeds."""

    name: str
    val_losses: list[float]  # one per seed
    state_bytes_per_param: float
    step_ms: float  # optimizer.step(), mean over the seeds
    val_ratios: list[float]  # per seed: val loss / AdamW's of the same seed
    val_ratio: float  # geometric mean of val_ratios
    low: float  # its 95 % interval (NaN for AdamW, whose ratios are all 1)
    high: float
    verdict: str


def verdict(ratio: float, low: float, high: float) -> str:
    """The wording of a row from the mean ratio and its 95 % interval."""
    if not all(math.isfinite(x) for x in (ratio, low, high)):
        return "did not train (non-finite loss)"
    if low <= 1 <= high:
        return f"within run-to-run noise ({100 * (ratio - 1):+.1f} %)"
    word = "worse" if ratio > 1 else "better"
    return f"{100 * abs(ratio - 1):.1f} % {word}, outside it"


def summarise(config: MemoryConfig, results: Mapping) -> dict:
    """Rows (paired ratios, their interval, the verdict) from the jobs' results."""
    runs = {
        name: [results[("memory", name, s)] for s in config.seeds]
        for name in config.optimizers
    }
    adamw = [r.val_loss for r in runs["adamw"]]
    rows = []
    for name, rs in runs.items():
        vals = [r.val_loss for r in rs]
        ratios = [v / a for v, a in zip(vals, adamw, strict=True)]
        mean, low, high = ratio_interval(ratios)
        rows.append(
            MemoryRow(
                name=name,
                val_losses=vals,
                state_bytes_per_param=rs[0].state_bytes_per_param,
                step_ms=statistics.fmean(r.step_ms for r in rs),
                val_ratios=ratios,
                val_ratio=mean,
                low=math.nan if name == "adamw" else low,
                high=math.nan if name == "adamw" else high,
                verdict="baseline" if name == "adamw" else verdict(mean, low, high),
            )
        )
    return {"rows": rows, "runs": runs}


def _interval(r: MemoryRow) -> str:
    if r.name == "adamw":
        return "1 (baseline)"
    return f"{fmt(r.val_ratio, '.3f')} [{fmt(r.low, '.3f')}, {fmt(r.high, '.3f')}]"


def table(summary: dict, config: MemoryConfig) -> str:
    """Markdown table of the memory axis, every ratio to AdamW of the same run."""
    rows = summary["rows"]
    base = next(r for r in rows if r.name == "adamw")
    seeds = ", ".join(f"seed {s}" for s in config.seeds)
    header = [
        "optimizer",
        "state B/param",
        "x AdamW",
        "opt.step ms",
        "x AdamW",
        f"val loss ({seeds})",
        "val x AdamW, per seed",
        "val x AdamW [95 % interval]",
        "verdict",
    ]
    body = [header, ["---"] + ["---:"] * 7 + ["---"]]
    under_load = summary.get("under_load", ())
    for r in rows:
        timed = any(("memory", r.name, s) in under_load for s in config.seeds)
        body.append(
            [
                mark_under_load(label(r.name), timed),
                fmt(r.state_bytes_per_param, ".3f"),
                fmt(r.state_bytes_per_param / base.state_bytes_per_param, ".3f"),
                fmt(r.step_ms, ".2f"),
                fmt(r.step_ms / base.step_ms, ".2f"),
                ", ".join(fmt(v, ".4f") for v in r.val_losses),
                ", ".join(fmt(v, ".3f") for v in r.val_ratios),
                _interval(r),
                r.verdict,
            ]
        )
    return markdown_table(body)


def settings(config: MemoryConfig, summary: dict) -> str:
    """One line: the model, the data and the training settings."""
    first = _task(config, config.seeds[0])
    return (
        f"{first.description}; {config.steps} steps, batch {config.batch_size}, "
        f"lr {config.lr} with a {config.warmup}-step warm-up and a cosine decay to "
        f"10 %, seeds {', '.join(map(str, config.seeds))}"
    )


def describe(config: MemoryConfig) -> str:
    """What the axis runs, for ``leantrain compare memory --help``."""
    c = config
    names = ", ".join(label(n) for n in c.optimizers)
    return (
        f"AdamW against Gefen: {names} each train a GPT (d_model {c.d_model}, "
        f"{c.n_layer} block(s), {c.n_head} heads, context {c.block_size}) on the "
        f"embedded text '{c.data}' for {c.steps} steps of {c.batch_size} sequences, "
        f"lr {c.lr} with a {c.warmup}-step warm-up and a cosine decay to 10 %, once "
        f"per seed ({len(c.seeds)} seeds from --seed), from the same weights on the "
        "same batches within a seed; the verdict is worded from the paired ratios "
        "of the validation loss to AdamW's and their 95 % interval."
    )


EXPLANATION = (
    "State B/param: optimizer_state_nbytes / parameters. Opt.step ms: mean "
    "optimizer.step() time (first step excluded, which builds the state), mean over "
    "the seeds. Val loss: mean over fixed validation batches after training (nats "
    "per byte), one per seed. Val x AdamW, per seed: the run's val loss over AdamW's "
    "of the same seed (same initial weights and batches); their spread is the "
    "run-to-run noise. Interval: geometric mean of those ratios and its 95 % "
    "interval (Student t on the log ratios). Verdict: "
    "'within run-to-run noise' when the interval holds 1, else how far worse or "
    "better."
)


def record(summary: dict) -> dict:
    """The axis' entries of compare.json."""
    return {
        "rows": [asdict(r) for r in summary["rows"]],
        "runs": {name: [asdict(r) for r in rs] for name, rs in summary["runs"].items()},
    }


def plot(ax, summary: dict) -> None:
    """Val loss over AdamW's per Gefen setting: one dot per seed, the geometric mean
    and its 95 % interval (clipped to the axes when it is very wide)."""
    rows = [r for r in summary["rows"] if r.name != "adamw"]
    ax.axhline(1.0, color="0.5", lw=1, label="AdamW")
    spread = [v for r in rows for v in r.val_ratios]
    lo, hi = min(spread + [1.0]), max(spread + [1.0])
    pad = max(0.02, 0.5 * (hi - lo))
    for k, r in enumerate(rows):
        ax.scatter([k] * len(r.val_ratios), r.val_ratios, color=f"C{k}", zorder=3)
        if math.isfinite(r.low):
            ax.errorbar(
                [k + 0.15],
                [r.val_ratio],
                yerr=[[r.val_ratio - r.low], [r.high - r.val_ratio]],
                fmt="s",
                color=f"C{k}",
                capsize=4,
            )
    ax.set_ylim(lo - pad, hi + pad)
    labels = [f"{label(r.name)}\n{r.state_bytes_per_param:.2f} B/param" for r in rows]
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set(
        ylabel="val loss / AdamW's (same seed)",
        title="memory: paired ratio per seed, mean [95 %]",
    )
    ax.legend(fontsize=7)
