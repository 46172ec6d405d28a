"""Layer-parallel GPT on the Python standard library's own source (bytes).

A GPT with N = 32 ODE blocks (h = 1/N) trained layer-parallel on 2 gloo processes
(MGRIT, L = 2, cf = 4, 2 forward / 1 adjoint cycles) under the convergence
Controller, switched to serial for the last quarter, against plain serial training
from the same initialisation on the same batches. Plots both validation curves.

Run: ``python examples/lp_gpt.py`` (a few minutes on 2 cores); see ``--help``.

The training loop every rank runs (see ``examples/_lp_demo.py``)::

    model = GPT(GPTConfig(n_layer=32, d_model=32, t_final=1.0))
    model.stack = LayerParallel(model.stack, cf=4, fwd_iters=2, bwd_iters=1)
    parallelize(model, ParallelDims(dp=1, lp=2).build_mesh())
    ctrl = Controller(model, every=50)
    for x, y in batches:                  # the same batch on every rank
        loss = lm_loss(model(x), y)       # output broadcast from the last rank
        opt.zero_grad(); loss.backward()  # adjoint MGRIT; own layers' grads only
        ctrl.step(); opt.step()
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _lp_demo import Demo, parser, run  # noqa: E402

from leantrain.data import TokenBatches, fixed_token_batches, load_stdlib_text  # noqa: E402
from leantrain.models import GPT, GPTConfig, lm_loss  # noqa: E402

BLOCK, BATCH = 32, 16


def make_demo(args) -> Demo:
    corpus = load_stdlib_text()
    config = GPTConfig(
        block_size=BLOCK,
        n_layer=args.layers,
        n_head=4,
        d_model=args.d_model,
        t_final=1.0,  # h = 1/N: the ODE regime in which MGRIT converges
    )

    def build():
        import torch

        torch.manual_seed(0)
        return GPT(config)

    return Demo(
        name="lp_gpt",
        build=build,
        batches=lambda: TokenBatches(
            corpus.train, block_size=BLOCK, batch_size=BATCH, seed=1
        ),
        val=fixed_token_batches(
            corpus.val, 8, block_size=BLOCK, batch_size=BATCH, seed=2
        ),
        loss=lm_loss,
    )


if __name__ == "__main__":
    run(make_demo, parser(__doc__.splitlines()[0]).parse_args())
