"""Where does Gefen's validation-loss gap to AdamW come from? A partition study.

Trains ``GPT.default()`` on the embedded stdlib text from one initialisation and one
data order with AdamW and with Gefen variants that switch one thing at a time
(momentum width, block partition of 2-D tensors, per-element second moment for 1-D
tensors), and prints the validation loss of each as a ratio to AdamW's (same run).

Run: ``python benchmarks/gefen_quality.py`` (200 steps, lr 2e-3, about 2 minutes per
variant on one idle core); ``--variants adamw,fp32:auto,8:auto`` picks variants,
``BITS:PARTITION[:1d-element][:nearest|:stochastic][:blocks|:factored][:noclip|:clipX]``,
BITS in fp32/8/4, PARTITION auto/element/tensor/INT; ``nearest``/``stochastic`` set
``momentum_rounding`` (default "auto"), ``blocks``/``factored`` set ``second_moment``
(default "auto": factored for 4-bit, blocks for 8-bit) and ``noclip``/``clip2`` set
``update_clip`` to None/2.0 (default "auto": 1.0 for 4-bit, None for 8-bit).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from tqdm import tqdm

from leantrain.data import TokenBatches, fixed_token_batches, load_stdlib_text
from leantrain.models import GPT
from leantrain.models.gpt import lm_loss
from leantrain.optim import Gefen, bytes_per_param

DEFAULT_VARIANTS = (
    "adamw,fp32:element,fp32:auto,fp32:auto:1d-element,fp32:128,fp32:128:1d-element,"
    "fp32:32,fp32:tensor,8:auto,4:auto"
)


def make_optimizer(
    spec: str, model: torch.nn.Module, lr: float
) -> torch.optim.Optimizer:
    if spec == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    bits, partition, *extra = spec.split(":")
    bits = None if bits == "fp32" else int(bits)
    partition = int(partition) if partition.isdigit() else partition
    options = {"lr": lr, "momentum_bits": bits, "partition": partition}
    for rounding in ("nearest", "stochastic"):
        if rounding in extra:
            extra.remove(rounding)
            options["momentum_rounding"] = rounding
    for second_moment in ("blocks", "factored"):
        if second_moment in extra:
            extra.remove(second_moment)
            options["second_moment"] = second_moment
    for option in list(extra):  # "noclip": update_clip=None; "clip2": 2.0
        if option == "noclip" or option.startswith("clip"):
            extra.remove(option)
            options["update_clip"] = None if option == "noclip" else float(option[4:])
    if extra == ["1d-element"]:
        one = [p for p in model.parameters() if p.ndim == 1]
        rest = [p for p in model.parameters() if p.ndim != 1]
        groups = [{"params": one, "partition": "element"}, {"params": rest}]
        return Gefen(groups, **options)
    if extra:
        raise ValueError(f"unknown variant suffix {extra!r} in {spec!r}")
    return Gefen(model.parameters(), **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    corpus = load_stdlib_text()
    torch.manual_seed(0)
    base = GPT.default()
    val = fixed_token_batches(corpus.val, 8, block_size=64, batch_size=16, seed=1)
    rows = []
    for spec in args.variants.split(","):
        model = copy.deepcopy(base)
        opt = make_optimizer(spec, model, args.lr)
        batches = iter(TokenBatches(corpus.train, block_size=64, batch_size=16, seed=0))
        start = time.perf_counter()
        for _ in tqdm(range(args.steps), desc=spec, leave=False):
            x, y = next(batches)
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            val_loss = sum(lm_loss(model(x), y).item() for x, y in val) / len(val)
        rows.append((spec, val_loss, bytes_per_param(opt), time.perf_counter() - start))
    baseline = next((v for s, v, _, _ in rows if s == "adamw"), rows[0][1])
    print(f"GPT.default(), {args.steps} steps, lr {args.lr}, batch 16 x 64 tokens")
    print(f"{'variant':26s} {'val loss':>9s} {'x AdamW':>8s} {'B/param':>8s} {'s':>6s}")
    for spec, val_loss, bpp, seconds in rows:
        ratio = val_loss / baseline
        print(f"{spec:26s} {val_loss:9.4f} {ratio:8.3f} {bpp:8.3f} {seconds:6.0f}")


if __name__ == "__main__":
    main()
