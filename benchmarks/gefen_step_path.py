"""The path of one ``Gefen.step``: the files and calls it visits, and where each
option's update is written.

Part 1 (measured): Gefen at its defaults (8-bit, and 4-bit) on ``GPT.default()``
with fixed gradients; ``sys.setprofile`` records every Python function called
from a file under ``leantrain/optim/`` during one step, for the first step (state,
partition and codebook creation), the second (the full path) and a steady step
(the tenth). It prints the distinct files and the number of calls of each.

Part 2 (from the sources): for each option beyond AdamW's, the implementations of
the update that write it (the reference step, the chunked PyTorch fallback whose
chunk function is also the compiled CUDA chunk, the C kernel); each entry names
the file and a marker of the code, and the script checks the marker is there.

Usage::

    PYTHONPATH=$PWD python benchmarks/gefen_step_path.py
    PYTHONPATH=/path/to/another/checkout python benchmarks/gefen_step_path.py
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

import leantrain
from leantrain.optim import Gefen

OPTIM = Path(leantrain.__file__).resolve().parent / "optim"

# option -> [(implementation, file under leantrain/optim, marker in that file)]
IMPLEMENTATIONS: dict[str, list[tuple[str, str, str]]] = {
    "weight_decay": [
        ("reference", "_step.py", "1 - lr * weight_decay"),
        ("torch/CUDA chunk", "_torch_step.py", 'mul_(h["decay"])'),
        ("C kernel", "_kernels/gefen_step.c", "p[k] * decay"),
    ],
    "maximize": [
        ("reference", "_step.py", "if maximize:"),
        ("torch/CUDA chunk", "_torch_step.py", "sign = -1.0 if"),
        ("C kernel", "_kernels/gefen_step.c", "g[k] * sign"),
    ],
    "update_clip": [
        ("reference", "_step.py", "clamp_(-bound, bound)"),
        ("torch/CUDA chunk", "_torch_step.py", "def _clipped"),
        ("C kernel", "_kernels/gefen_step.c", "lt_clip("),
    ],
    "partition='element' (period 1)": [
        ("reference", "_step.py", "if period == 1:"),
        ("torch/CUDA chunk", "_torch_step.py", "elif period == 1:"),
        ("C kernel", "_kernels/gefen_step.c", "if (per_element_v)"),
    ],
    "momentum_bits=4 (packed codes)": [
        ("reference", "_step.py", "pack_nibbles(codes)"),
        ("torch/CUDA chunk", "_torch_step.py", "def write_codes"),
        ("C kernel", "_kernels/gefen_codes.h", "lt_store_codes"),
    ],
    "momentum_rounding='stochastic'": [
        ("reference", "_step.py", "code_rounding.round_blocks"),
        ("torch/CUDA chunk", "_torch_step.py", "code_rounding.stochastic_index"),
        ("C kernel", "_kernels/gefen_sr.h", "lt_lookup16_sr"),
    ],
    "stochastic_rounding (bf16 parameters)": [
        ("torch/CUDA chunk", "_torch_step.py", "round_to("),
        ("C kernel", "_kernels/gefen_io.h", "lt_float_to_bf16_sr"),
    ],
    "second_moment='factored'": [
        ("reference", "_step.py", "factored.factored_denominator"),
        ("torch/CUDA chunk", "_torch_step.py", "factored_denominator("),
        ("C kernel", "_kernels/gefen_factored.h", "lt_factor_tile"),
    ],
    "nonfinite (the check)": [
        ("Python (full path)", "_checks.py", "def finite_flags"),
        ("C kernel (steady step)", "_kernels/gefen_prepass.h", "lt_piece_finite"),
    ],
}


def visited(step) -> Counter:
    """file name (relative to leantrain/optim) -> Python calls during ``step()``."""
    calls: Counter = Counter()
    root = str(OPTIM)

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root):
                calls[str(Path(name).relative_to(root))] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def trace(bits: int) -> None:
    from leantrain.models.gpt import GPT

    torch.manual_seed(0)
    params = list(GPT.default().parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt = Gefen(params, lr=1e-3, momentum_bits=bits)
    print(f"Gefen {bits}-bit (defaults) on GPT.default(), {len(params)} tensors")
    for number in range(1, 11):
        calls = visited(opt.step)
        if number in (1, 2, 10):
            what = {1: "first step", 2: "second step", 10: "steady step (10th)"}
            files = ", ".join(f"{f} {n}" for f, n in sorted(calls.items()))
            print(
                f"  {what[number]:19s} {len(calls):2d} files, "
                f"{sum(calls.values()):5d} calls: {files}"
            )


def implementations() -> None:
    print("Implementations of each option's update (checked against the sources)")
    for option, places in IMPLEMENTATIONS.items():
        for _, path, marker in places:
            if marker not in (OPTIM / path).read_text():
                raise SystemExit(f"{option}: {marker!r} not found in {path}")
        where = "; ".join(f"{kind}: {path}" for kind, path, _ in places)
        print(f"  {option:40s} {len(places)}  ({where})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--no-sources", action="store_true", help="skip part 2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"leantrain from {OPTIM.parent}")
    for bits in args.bits:
        trace(bits)
    if not args.no_sources:
        implementations()


if __name__ == "__main__":
    main()
