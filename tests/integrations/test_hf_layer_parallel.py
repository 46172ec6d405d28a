"""Layer-parallel Hugging Face models (``layer_parallel_hf``), float64, tiny configs.

* ``dt = 1`` in serial mode is the HF model: logits, loss and every parameter gradient
  against an untouched copy of the model (1e-10), for GPT-2, Llama, BERT and ViT, with
  their heads and as base models, with a padding attention mask.
* With ``t_final`` set the stack is the ODE ``x + h (B(x) - x)``: the reference is the
  untouched HF model whose blocks' forwards are patched in the test to that damped
  step, so the HF model's own loop computes the serial solve. The serial mode and MGRIT
  iterated to exactness (both solvers) equal it; one inexact cycle does not.
* A 2-process gloo run of GPT-2 (``parallelize`` over an ``lp`` mesh, MGRIT forward
  and the serial forward with an MGRIT adjoint) equals the one-process serial solve
  (slow: the spawned processes import transformers).
* Refusals name the option; state-dict keys stay the HF model's.
"""

from __future__ import annotations

import copy
import doctest
import re

import pytest
import torch

import leantrain.integrations.hf_layer_parallel as hf_lp
from leantrain.integrations import HFLayerParallel, layer_parallel_hf
from tests._helpers.hf_models import (
    image_batch,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
    tiny_vit,
    token_batch,
)

N = 4  # layers: N / chunks = 2 is a multiple of cf = 2


def _model(family: str, base: bool = False):
    factory = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}
    model = factory.get(family, tiny_vit)(dtype=torch.float64, layers=N)
    return model.base_model if base else model


def _inputs(family: str, base: bool = False) -> dict:
    if family == "vit":
        x, y = image_batch(dtype=torch.float64)
        return {"pixel_values": x} if base else {"pixel_values": x, "labels": y}
    ids = token_batch()
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0  # a padded sequence: the mask must reach every block
    return {"input_ids": ids, "attention_mask": mask} | (
        {} if base else {"labels": ids}
    )


def _run(model, inputs: dict):
    """Output (logits or last hidden state), loss and named parameter gradients."""
    out = model(**inputs)
    y = out.logits if hasattr(out, "logits") else out.last_hidden_state
    if getattr(out, "loss", None) is not None:
        loss = out.loss
    else:
        g = torch.Generator().manual_seed(5)
        loss = (y * torch.randn(y.shape, generator=g, dtype=y.dtype)).sum()
    loss.backward()
    grads = {
        _hf_name(k): None if p.grad is None else p.grad.clone()
        for k, p in model.named_parameters()
    }
    return y.detach(), loss.detach(), grads


def _hf_name(name: str) -> str:
    return re.sub(r"\.steps\.(\d+)\.block\.", r".\1.", name)


def _assert_close(a, b, tol: float) -> None:
    ya, la, ga = a
    yb, lb, gb = b
    assert (ya - yb).abs().max().item() < tol
    assert abs(la.item() - lb.item()) < tol
    assert ga.keys() == gb.keys()
    for k in ga:
        assert (ga[k] - gb[k]).abs().max().item() < tol, k


def _damp(model, h: float) -> None:
    """Patch each HF block's forward to ``x + h (B(x) - x)`` (the test's reference)."""
    blocks = _find_blocks(model)
    for block in blocks:
        inner = block.forward

        def forward(x, *args, _inner=inner, **kwargs):
            return x + h * (_inner(x, *args, **kwargs) - x)

        block.forward = forward


def _find_blocks(model):
    base = model.base_model
    for path in (("h",), ("layers",), ("encoder", "layer")):
        m = base
        for attr in path:
            m = getattr(m, attr, None)
        if isinstance(m, torch.nn.ModuleList):
            return m
    raise AssertionError("no blocks")


FAMILIES = ["gpt2", "llama", "bert", "vit"]


@pytest.mark.parametrize("base", [False, True], ids=["head", "base"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dt_one_serial_is_the_hf_model(family, base):
    ref = _model(family, base)
    model = copy.deepcopy(ref)
    stack = layer_parallel_hf(model).serial()
    assert stack.dt == 1.0 and len(stack.steps) == N
    inputs = _inputs(family, base)
    _assert_close(_run(ref, inputs), _run(model, inputs), 1e-10)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", FAMILIES)
def test_t_final_mgrit_to_exactness_equals_the_serial_ode(family, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    h = 0.25  # t_final = 1
    ref = _model(family).to(device)
    inputs = {k: v.to(device) for k, v in _inputs(family).items()}
    options = dict(t_final=1.0, levels=2, cf=2, chunks=2, skip_downcycle=False)
    # N / (2 cf) = 1 cycle is exact; 2 leave no doubt
    exact = copy.deepcopy(ref)
    layer_parallel_hf(exact, fwd_iters=2, bwd_iters=2, **options)
    serial = copy.deepcopy(exact)
    _find_lp(serial).serial()
    serial_fwd = copy.deepcopy(exact)
    _find_lp(serial_fwd).forward_solver = "serial"
    inexact = copy.deepcopy(ref)
    skip = options | {"skip_downcycle": True}
    layer_parallel_hf(inexact, fwd_iters=1, bwd_iters=1, **skip)
    _damp(ref, h)
    expected = _run(ref, inputs)
    _assert_close(expected, _run(serial, inputs), 1e-10)
    _assert_close(expected, _run(exact, inputs), 1e-10)
    _assert_close(expected, _run(serial_fwd, inputs), 1e-10)
    assert _find_lp(exact).stats.backward.iterations == 2
    assert all(p.device.type == device for p in exact.parameters())
    # the comparison resolves a wrong solve: one coarse-only cycle is not exact
    y, _, grads = _run(inexact, inputs)
    assert (y - expected[0]).abs().max().item() > 1e-9


def _find_lp(model) -> HFLayerParallel:
    return next(m for m in model.modules() if isinstance(m, HFLayerParallel))


def test_state_dict_keys_are_the_hf_models_and_load_both_ways(tmp_path):
    import transformers

    ref = _model("gpt2")
    model = copy.deepcopy(ref)
    layer_parallel_hf(model, t_final=1.0, cf=2)
    assert list(model.state_dict()) == list(ref.state_dict())
    model.save_pretrained(tmp_path)  # a layer-parallel model saves a plain HF one
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float64)
    ids = token_batch()
    assert torch.equal(plain(ids).logits, ref(ids).logits)
    fresh = tiny_gpt2(dtype=torch.float64, layers=N, seed=1)
    fresh.load_state_dict(model.state_dict())  # layer-parallel -> plain HF
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(ref.state_dict())  # plain HF -> layer-parallel
    for (k, a), b in zip(
        ref.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k
    assert model.config.use_cache is False
    stack = model.transformer.h
    assert list(stack) == [stack] and stack[:] == [stack]


def test_micro_batches_backward_in_any_order_use_their_own_masks():
    # Inexact MGRIT recomputes coarse blocks in backward; with two forwards before
    # one backward each must see its own attention mask.
    ref = _model("llama")
    layer_parallel_hf(ref, t_final=1.0, cf=2, fwd_iters=1, bwd_iters=1)
    model = copy.deepcopy(ref)
    ids = token_batch()
    masks = torch.ones_like(ids), torch.ones_like(ids)
    masks[1][:, -5:] = 0
    for mask in masks:  # forward, backward, forward, backward
        ref(ids, attention_mask=mask, labels=ids).loss.backward()
    losses = [model(ids, attention_mask=m, labels=ids).loss for m in masks]
    sum(losses).backward()  # both forwards first, then one backward
    for (k, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max().item() < 1e-12, k
    assert _find_lp(model).stats.backward.iterations == 1


def test_controller_watches_an_hf_stack():
    from leantrain.layer_parallel import Controller

    model = _model("gpt2")
    stack = layer_parallel_hf(model, t_final=1.0, cf=2, fwd_iters=1, bwd_iters=1)
    ctrl = Controller(model, every=1)
    assert ctrl.stacks == [stack]
    ids = token_batch()
    model(ids, labels=ids).loss.backward()
    decision = ctrl.step()
    # the check batch ran doubled cycles, so both solves report a factor
    assert stack.stats.forward.iterations == 2
    assert 0 < decision.forward_factor < 1 and 0 < decision.backward_factor < 1
    assert decision.action == "keep" and decision.fwd_iters == 1


def test_refusals_name_the_option():
    with pytest.raises(TypeError, match="supports models built on"):
        layer_parallel_hf(torch.nn.Linear(2, 2))
    model = _model("gpt2")
    layer_parallel_hf(model)
    with pytest.raises(ValueError, match="already layer-parallel"):
        layer_parallel_hf(model)
    ids = token_batch()
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="output_hidden_states"):
        model(ids, output_hidden_states=True)
    with pytest.raises(ValueError, match="key-value cache"):
        model(ids, use_cache=True)
    with pytest.raises(IndexError, match="runs all 4 layers"):
        model.transformer.h[:2]
    with pytest.raises(TypeError, match=r"HF block n is stack.steps\[n\].block"):
        model.transformer.h[0]
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    mask = torch.zeros(2, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="attention_mask requires grad"):
        model.transformer.h(x, attention_mask=mask)
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="checkpointing is on in"):
        model(ids)

    checkpointed = _model("llama")
    checkpointed.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="checkpointing is on"):
        layer_parallel_hf(checkpointed)


def test_dropout_is_refused_in_training_only():
    import transformers

    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).double()
    layer_parallel_hf(model, cf=2).serial()
    ids = token_batch()
    model.train()
    with pytest.raises(ValueError, match=r"dropout p=0.1 in steps.0.block.attn"):
        model(ids)
    model.eval()
    assert model(ids).logits.shape == (4, 12, 64)


def test_docstring_example_runs():
    result = doctest.testmod(hf_lp, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def _gpt2_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    from tests._helpers.launchers import parallelize_over_all_ranks

    ref = tiny_gpt2(dtype=torch.float64, layers=N)
    inputs = _inputs("gpt2")
    options = dict(t_final=1.0, levels=2, cf=2, fwd_iters=2, bwd_iters=2)
    serial = copy.deepcopy(ref)
    layer_parallel_hf(serial, **options).serial()
    y0, l0, g0 = _run(serial, inputs)
    results = {}
    for solver in ("mgrit", "serial"):  # MGRIT forward; serial forward, MGRIT adjoint
        model = copy.deepcopy(ref)
        stack = parallelize_over_all_ranks(
            layer_parallel_hf(
                model, skip_downcycle=False, forward_solver=solver, **options
            )
        )
        y1, l1, g1 = _run(model, inputs)
        layer = {k: re.match(r"transformer\.h\.(\d+)\.", k) for k in g1}
        own = stack.owned_layers
        mine = [k for k, m in layer.items() if not m or int(m[1]) in own]
        results[solver] = {
            "logits": (y0 - y1).abs().max().item(),
            "loss": abs(l0.item() - l1.item()),
            "grads": max((g0[k] - g1[k]).abs().max().item() for k in mine),
            # the other rank's layers run and train there: no gradient here
            "foreign_grads": float(any(g1[k] is not None for k in g1 if k not in mine)),
            "owned": float(len(own)),
        }
    return results


@pytest.mark.slow  # two spawned processes importing transformers: over a minute here
@pytest.mark.distributed
def test_two_process_gpt2_equals_serial():
    from tests._helpers.launchers import run_distributed

    for per_solver in run_distributed(_gpt2_worker, 2, timeout=120):
        for result in per_solver.values():
            assert result["owned"] == N / 2
            assert result["logits"] < 1e-10 and result["loss"] < 1e-10
            assert result["grads"] < 1e-10 and result["foreign_grads"] == 0.0
