"""MGRIT convergence on a Hugging Face GPT-2 stack: ``dt = 1`` against ``t_final = 1``.

A random-init ``GPT2LMHeadModel`` (32 blocks, d 64, 4 heads, the HF initialisation, no
dropout, float64) is made layer-parallel with ``layer_parallel_hf`` twice from the same
weights: with the default ``t_final = N`` (``dt = 1``, the HF network itself) and with
``t_final = 1`` (``h = 1/N``). One training step (L = 2, cf = 4, 3 forward and 3
adjoint cycles, batch 4 x 32 tokens) prints the convergence factors of both solves
(``stats.forward.factors``, ``stats.backward.factors``) for two seeds.

Run: ``python benchmarks/hf_lp_convergence.py`` (about a minute on one CPU thread).
"""

from __future__ import annotations

import copy
import warnings

import torch
import transformers

from leantrain.integrations import layer_parallel_hf


def main() -> None:
    warnings.simplefilter("ignore")  # HF config notices; the factors are the output
    torch.set_num_threads(1)
    print("| seed | t_final | forward factors | adjoint factors |\n|---|---|---|---|")
    for seed in (0, 1):
        torch.manual_seed(seed)
        config = transformers.GPT2Config(
            vocab_size=256,
            n_positions=64,
            n_embd=64,
            n_layer=32,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        base = transformers.GPT2LMHeadModel(config).double()
        ids = torch.randint(0, 256, (4, 32))
        for t_final in (None, 1.0):
            model = copy.deepcopy(base)
            stack = layer_parallel_hf(
                model, t_final=t_final, cf=4, fwd_iters=3, bwd_iters=3
            )
            model(ids, labels=ids).loss.backward()
            fwd, bwd = stack.stats.forward.factors, stack.stats.backward.factors
            label = "N (dt = 1)" if t_final is None else f"{t_final:g}"
            print(
                f"| {seed} | {label} | {', '.join(f'{x:.3g}' for x in fwd)} | "
                f"{', '.join(f'{x:.3g}' for x in bwd)} |"
            )


if __name__ == "__main__":
    main()
