"""leantrain assumes no torch global state.

Three process-wide settings users turn on: a float64 default dtype
(``torch.set_default_dtype``), ``torch.use_deterministic_algorithms(True)`` and
anomaly detection (``torch.autograd.set_detect_anomaly(True)``). Under each, Gefen
(8-bit and 4-bit momentum; also on a Hugging Face GPT-2), GefenMuon, the K-FAC and
Shampoo gradient makers and ``LayerParallel`` produce bit for bit what they produce
without it. The model is built before the setting is turned on, so any difference
comes from a tensor the library creates itself (for example the +inf sentinel of
Gefen's quantization table, which must be fp32 for the table's bit layout). Every
test restores the settings it changed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from leantrain.layer_parallel import LayerParallel
from leantrain.models.blocks import TransformerBlock
from leantrain.optim import Gefen, GefenMuon, muon_param_groups
from leantrain.precond import (
    KfacGradientMaker,
    PreconditioningConfig,
    ShampooGradientMaker,
)
from tests._helpers.hf_models import tiny_gpt2, token_batch
from tests._helpers.models import tiny_gpt

VOCAB, SEQ, BATCH = 32, 8, 4


@contextlib.contextmanager
def _float64_default() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    old = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old, warn_only=warn_only)


@contextlib.contextmanager
def _anomaly() -> Iterator[None]:
    with torch.autograd.set_detect_anomaly(True):
        yield


SETTINGS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "float64_default": _float64_default,
    "deterministic_algorithms": _deterministic,
    "detect_anomaly": _anomaly,
}


def _global_state() -> tuple:
    return (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.is_anomaly_enabled(),
    )


@pytest.fixture(autouse=True)
def _restores_global_state():
    """Each test leaves torch's global settings as it found them (and fails if not)."""
    before = _global_state()
    yield
    after = _global_state()
    torch.set_default_dtype(before[0])
    torch.use_deterministic_algorithms(before[1], warn_only=before[2])
    torch.autograd.set_detect_anomaly(before[3])
    assert after == before, f"global state leaked: {before} -> {after}"


# _tiny_gpt(seed=0): the shared builder at this file's sizes.
_tiny_gpt = functools.partial(tiny_gpt, vocab_size=VOCAB, block_size=SEQ, d_model=16)


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _assert_same(expected: list[torch.Tensor], actual: list[torch.Tensor]) -> None:
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert a.dtype == e.dtype, f"tensor {i}: dtype {a.dtype}, expected {e.dtype}"
        assert torch.equal(a, e), f"tensor {i} differs by {(a - e).abs().max()}"


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state_dict()["state"].values():
        out += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def _train_gefen(kind: str, setting: str | None) -> list[torch.Tensor]:
    """Three steps on the tiny GPT; returns the parameters and optimizer state."""
    model = _tiny_gpt()
    context = SETTINGS[setting]() if setting else contextlib.nullcontext()
    with context:
        if kind == "muon":
            groups = muon_param_groups(model)
            optimizer = GefenMuon(groups, lr=2e-2)
        else:
            bits = {"gefen8": 8, "gefen4": 4}[kind]
            optimizer = Gefen(model.parameters(), lr=1e-2, momentum_bits=bits)
        for step in range(3):
            x, t = _tokens(step)
            optimizer.zero_grad()
            _lm_loss(model(x), t).backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()] + _state_tensors(optimizer)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("kind", ["gefen8", "gefen4", "muon"])
def test_optimizers_ignore_global_settings(kind, setting):
    expected = _train_gefen(kind, None)
    actual = _train_gefen(kind, setting)
    _assert_same(expected, actual)


def test_gefen_state_is_fp32_under_float64_default():
    """The state layout (docs/CONTRACTS.md) is fixed: fp32 statistics whatever the
    default dtype, so checkpoints from either process load into the other."""
    model = _tiny_gpt()
    with _float64_default():
        optimizer = Gefen(model.parameters(), lr=1e-2)
        x, t = _tokens(0)
        _lm_loss(model(x), t).backward()
        optimizer.step()
    floats = {
        key: value.dtype
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    }
    assert floats and set(floats.values()) == {torch.float32}, floats


MAKERS = {"kfac": KfacGradientMaker, "shampoo": ShampooGradientMaker}


def _maker_gradients(name: str, setting: str | None) -> list[torch.Tensor]:
    """Two preconditioned gradients of the tiny GPT's language-model loss."""
    model = _tiny_gpt()
    # The position embedding sees a (1, T) input, not the batch; K-FAC needs each
    # tracked module to see the batch in dim 0, so it is left out here.
    config = PreconditioningConfig(damping=1e-3, ignore_modules=("wpe",))
    context = SETTINGS[setting]() if setting else contextlib.nullcontext()
    grads = []
    with context:
        maker = MAKERS[name](model, config)
        for step in range(2):
            model.zero_grad()
            x, t = _tokens(step)
            y = maker.setup_model_call(model, x)
            maker.setup_loss_call(_lm_loss, y, t)
            maker.forward_and_backward()
            grads += [p.grad.clone() for p in model.parameters()]
    return grads


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_gradient_makers_ignore_global_settings(name, setting):
    expected = _maker_gradients(name, None)
    actual = _maker_gradients(name, setting)
    _assert_same(expected, actual)


def _layer_parallel_gradients(setting: str | None) -> list[torch.Tensor]:
    """One MGRIT forward and adjoint through 8 transformer steps (2 ranks' chunks)."""
    torch.manual_seed(0)
    blocks = [TransformerBlock(16, 2, causal=True) for _ in range(8)]
    x = torch.randn(2, 5, 16, requires_grad=True)
    context = SETTINGS[setting]() if setting else contextlib.nullcontext()
    with context:
        stack = LayerParallel(blocks, cf=2, fwd_iters=2, bwd_iters=1, chunks=2)
        y = stack(x)
        y.square().mean().backward()
    return [y.detach(), x.grad] + [p.grad for p in stack.parameters()]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_layer_parallel_ignores_global_settings(setting):
    expected = _layer_parallel_gradients(None)
    actual = _layer_parallel_gradients(setting)
    _assert_same(expected, actual)


def _hf_gpt2_after_steps(setting: str | None) -> list[torch.Tensor]:
    model = tiny_gpt2()
    context = SETTINGS[setting]() if setting else contextlib.nullcontext()
    with context:
        optimizer = Gefen(model.parameters(), lr=1e-2)
        for seed in range(3):
            ids = token_batch(seed=seed)
            optimizer.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()] + _state_tensors(optimizer)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_gefen_on_hf_gpt2_ignores_global_settings(setting):
    """The same on a Hugging Face GPT2LMHeadModel (its own loss, tied embeddings)."""
    _assert_same(_hf_gpt2_after_steps(None), _hf_gpt2_after_steps(setting))
