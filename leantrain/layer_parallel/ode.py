r"""The residual stack as an ODE: states, steps and per-layer randomness.

A residual stack ``x_{n+1} = x_n + h F_n(x_n)`` is forward Euler on ``dx/dt = F(x, t)``
over ``[0, T]`` with ``N`` steps of size ``h = T / N``. A *step* is any module with
``forward(state, dt) -> state``; the *state* is a Tensor or a tuple of Tensors (an
encoder-decoder carries ``(x, y)``). MGRIT needs nothing else from a model: its coarse
levels call the fine layer at the start of a coarse interval with a larger ``dt``.

Why ``T = 1`` by default: with ``h = 1`` (the plain ResNet) the coarse step
``x + cf * F(x)`` is far from ``cf`` fine steps and MGRIT does not converge (measured
convergence factor about 1); with ``h = 1/N`` the factor is about 0.05 (docs/ANCHORS).

Dropout inside a step must draw the *same* mask every time MGRIT re-evaluates that
layer within one batch (relaxation, residual, final sweep, adjoint recomputation).
:class:`LayerRNG` gives every (batch, layer) pair its own seed and runs the layer inside
``torch.random.fork_rng`` seeded with it, so the global random stream is untouched and
serial and layer-parallel execution see identical masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from leantrain import evaluation

State = torch.Tensor | tuple[torch.Tensor, ...]

_MASK64 = (1 << 64) - 1

# The one sentence every block-contract error ends with (construction and first call).
BLOCK_CONTRACT = (
    "A block is an nn.Module called as block(x, dt) that returns a state of x's "
    "shape: one residual step x + dt * F(x), where x is a Tensor or a tuple of "
    "Tensors and dt the step size."
)


@runtime_checkable
class Step(Protocol):
    """A residual step: ``forward(state, dt) -> state`` computing ``state + dt*f``."""

    def __call__(self, state: State, dt: float) -> State: ...


def as_tuple(state: State) -> tuple[torch.Tensor, ...]:
    """The state's tensors as a tuple (a Tensor becomes a 1-tuple)."""
    return (state,) if isinstance(state, torch.Tensor) else tuple(state)


def like(template: State, parts: Sequence[torch.Tensor]) -> State:
    """Pack ``parts`` into the structure of ``template`` (Tensor or tuple)."""
    return parts[0] if isinstance(template, torch.Tensor) else tuple(parts)


def add(a: State, b: State) -> State:
    """Elementwise ``a + b`` over matching states."""
    return like(a, [x + y for x, y in zip(as_tuple(a), as_tuple(b), strict=True)])


def sub(a: State, b: State) -> State:
    """Elementwise ``a - b`` over matching states."""
    return like(a, [x - y for x, y in zip(as_tuple(a), as_tuple(b), strict=True)])


def sq_norm(a: State) -> torch.Tensor:
    """Squared Euclidean norm of all tensors in the state, a 0-dim float64 tensor
    on the state's device.

    Accumulated in float64 without a float64 copy of the state (a residual norm is
    taken at every C-point of every sweep). It stays on the device: MGRIT sums the
    C-points' squares there and reads one number on the host per residual norm,
    not one per C-point.
    """
    return sum(
        torch.linalg.vector_norm(x.detach(), dtype=torch.float64) ** 2
        for x in as_tuple(a)
    )


def zeros_like(a: State) -> State:
    """A state of zeros shaped like ``a``."""
    return like(a, [torch.zeros_like(x) for x in as_tuple(a)])


def detach(a: State) -> State:
    """The state with every tensor detached from autograd."""
    return like(a, [x.detach() for x in as_tuple(a)])


def leaf(a: State) -> State:
    """Detached copies that require grad, to record one layer's graph on its own."""
    return like(a, [x.detach().requires_grad_() for x in as_tuple(a)])


def _splitmix64(x: int) -> int:
    # A bijective 64-bit mixer: nearby (batch, layer) pairs get unrelated seeds.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class LayerRNG:
    """Per-(batch, layer) random streams, so a layer's dropout mask is reproducible.

    Each evaluation of layer ``n`` runs under ``torch.random.fork_rng`` with the seed
    ``splitmix64(batch_seed * 2**20 + n)``; the caller's global RNG state is restored
    afterwards. A disabled LayerRNG (evaluation mode) runs layers without forking.

    Args:
        batch_seed: one integer per batch, e.g. drawn from the global generator.
        devices: CUDA device indices whose RNG state must be forked too.
        enabled: if False, :meth:`layer` is a no-op context.

    Example:
        >>> rng = LayerRNG(batch_seed=7)
        >>> drop = torch.nn.Dropout(0.5)
        >>> x = torch.ones(8)
        >>> with rng.layer(3):
        ...     a = drop(x)
        >>> with rng.layer(3):
        ...     b = drop(x)
        >>> torch.equal(a, b)
        True
    """

    def __init__(
        self, batch_seed: int, devices: Sequence[int] = (), *, enabled: bool = True
    ) -> None:
        self.batch_seed = int(batch_seed)
        self.devices = list(devices)
        self.enabled = enabled

    def seed(self, layer: int) -> int:
        """The seed used for ``layer`` in this batch (a non-negative 63-bit int)."""
        return _splitmix64((self.batch_seed << 20) + layer) >> 1

    @contextlib.contextmanager
    def layer(self, n: int) -> Iterator[None]:
        """Context in which layer ``n`` draws its random numbers."""
        if not self.enabled:
            yield
            return
        seed = self.seed(n)
        with torch.random.fork_rng(devices=self.devices):
            # Seed the generators directly: torch.manual_seed also queues lazy seeding
            # calls for every backend, each capturing a stack trace (~1 ms per layer).
            torch.default_generator.manual_seed(seed)
            for index in self.devices:
                torch.cuda.default_generators[index].manual_seed(seed)
            yield

    @staticmethod
    def draw(state: State, *, enabled: bool) -> LayerRNG:
        """A LayerRNG for a new batch, seeded from the global generator.

        The draw advances the global CPU generator only when ``enabled`` (training),
        so evaluation does not perturb the user's random stream.
        """
        devices = sorted(
            {t.device.index or 0 for t in as_tuple(state) if t.device.type == "cuda"}
        )
        seed = int(torch.randint(0, 2**62, (1,)).item()) if enabled else 0
        return LayerRNG(seed, devices, enabled=enabled)


def run_step(step: torch.nn.Module, state: State, dt: float, n: int, rng: LayerRNG):
    """Evaluate layer ``n`` as ``step(state, dt)`` inside its random stream.

    Raises:
        ValueError: if the step returns a state of other shapes than ``state`` (a
            block that changes the width), naming the layer and both shapes.
    """
    with rng.layer(n):
        out = step(state, dt)
    if not (
        isinstance(out, torch.Tensor)
        and isinstance(state, torch.Tensor)
        and out.shape == state.shape
    ):  # the common case above costs one comparison; tuples take the long way
        _check_same_shapes(step, n, state, out)
    return out


def _shapes(state: object) -> object:
    # A Tensor's shape, a tuple state's list of shapes, else the type's name.
    if isinstance(state, torch.Tensor):
        return tuple(state.shape)
    if isinstance(state, tuple | list) and all(
        isinstance(t, torch.Tensor) for t in state
    ):
        return [tuple(t.shape) for t in state]
    return type(state).__name__


def _check_same_shapes(step: object, n: int, state: State, out: object) -> None:
    # Checked where a block is run rather than at construction: the state's width is
    # known only at the first call, and a Hugging Face block cannot be probed on its
    # own (it needs the call's masks). Without it a width change surfaces as a matmul
    # error in a later layer, deep inside MGRIT.
    want, got = _shapes(state), _shapes(out)
    if want != got:
        raise ValueError(
            f"block {n} ({type(step).__name__}) returned a state of shape {got} for "
            f"an input of shape {want}: LayerParallel runs the blocks as the steps of "
            "one ODE, so no block may change the state's shape (change the width "
            f"outside the stack, e.g. in the embedding or the head). {BLOCK_CONTRACT}"
        )


def serial_forward(
    steps: Sequence[torch.nn.Module], state: State, h: float, rng: LayerRNG
) -> State:
    """Exact layer-by-layer execution (plain autograd): the reference for MGRIT."""
    for n, step in enumerate(steps):
        state = run_step(step, state, h, n, rng)
    return state


class StepPropagator:
    """Forward MGRIT propagator over a list of steps with fine step ``h``.

    Level ``l`` point ``j`` is reached by the fine layer at the start of the coarse
    interval, ``n = (j - 1) cf^l``, with ``dt = cf^l h``. Steps run without autograd,
    except in the final sweep when ``record`` is set: then each layer's input is a
    fresh leaf and its graph is kept (``inputs[n]``, ``outputs[n]``) for the adjoint.
    Every other evaluation runs under :func:`leantrain.evaluation.auxiliary`, the
    recorded one under :func:`leantrain.evaluation.detached`, so that hooks that
    collect curvature see each layer once, at the point the gradient is taken.

    Args:
        steps: the layers; ``steps[n]`` maps point ``n`` to ``n + 1``.
        h: fine step size ``T / N``.
        cf: coarsening factor.
        rng: the batch's per-layer random streams.
        record: keep the final sweep's graphs (training).

    Example:
        >>> steps = [lambda u, dt: u + dt * torch.tanh(u)] * 4
        >>> prop = StepPropagator(steps, h=0.25, cf=2, rng=LayerRNG(0, enabled=False))
        >>> u1 = prop(1, 1, torch.ones(3))  # one coarse step: layer 0 with dt = 0.5
        >>> torch.allclose(u1, 1 + 0.5 * torch.tanh(torch.ones(3)))
        True
    """

    def __init__(
        self,
        steps: Sequence[torch.nn.Module],
        h: float,
        cf: int,
        rng: LayerRNG,
        *,
        record: bool = False,
    ) -> None:
        self.steps, self.h, self.cf, self.rng, self.record = steps, h, cf, rng, record
        self.inputs: dict[int, State] = {}
        self.outputs: dict[int, State] = {}

    def __call__(self, level: int, j: int, u: State, *, final: bool = False) -> State:
        scale = self.cf**level
        n, dt = (j - 1) * scale, scale * self.h
        if final and self.record:
            # The evaluation the gradient is taken through: once per layer and call,
            # in a graph of its own (the adjoint links it to the caller's).
            x = leaf(u)
            with torch.enable_grad(), evaluation.detached():
                y = run_step(self.steps[n], x, dt, n, self.rng)
            self.inputs[n], self.outputs[n] = x, y
            return detach(y)
        with torch.no_grad(), evaluation.auxiliary():
            return run_step(self.steps[n], u, dt, n, self.rng)
