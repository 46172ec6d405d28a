"""Chunks ("ranks") and what crosses their boundaries: the MGRIT chunk layout.

The ``N`` steps are cut into ``P`` contiguous chunks of ``N/P`` steps; chunk ``p`` owns
fine points ``p N/P + 1 .. (p+1) N/P`` and the layers that step into them (the owner of
point ``i`` runs step ``i-1 -> i``). On level ``l`` it owns ``n_l = N / (P cf^l)``
points. Because ``n_l`` is a multiple of ``cf`` on every relaxed level, every
F-interval lies inside one chunk and a chunk needs exactly one state from outside: the
last point of its left neighbour (the "ghost"), before each F-relaxation, plus the
coarsest level's serial relay and one scalar reduction per residual.

:class:`Exchange` is that interface. :class:`LocalExchange` implements it for all
chunks in one process; a ``torch.distributed`` version (one chunk per rank) only has
to send/receive the same states.

The ideal cost of a solve on this layout (in layer steps) is
:mod:`leantrain.layer_parallel.costs.cycle_work`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from leantrain.layer_parallel._checks import check_layout
from leantrain.layer_parallel.ode import State


@dataclass(frozen=True)
class ChunkLayout:
    """Which points of which level each chunk owns.

    Args:
        n_steps: number of fine steps ``N``.
        chunks: number of chunks ``P``.
        cf: coarsening factor.
        levels: number of grid levels ``L`` (>= 2).

    Raises:
        ValueError: if ``N/P`` is not a multiple of ``cf**(L-1)``.

    Example:
        >>> layout = ChunkLayout(n_steps=16, chunks=2, cf=2, levels=3)
        >>> layout.per_chunk(0), layout.per_chunk(2), layout.offset(1, 1)
        (8, 2, 4)
    """

    n_steps: int
    chunks: int
    cf: int
    levels: int

    def __post_init__(self) -> None:
        check_layout(self.n_steps, self.chunks, self.cf, self.levels)

    def n_points(self, level: int) -> int:
        """Steps on level ``level`` (its grid has this many points plus point 0)."""
        return self.n_steps // self.cf**level

    def per_chunk(self, level: int) -> int:
        """Points each chunk owns on ``level``: ``n_l = N / (P cf^l)``."""
        return self.n_points(level) // self.chunks

    def offset(self, chunk: int, level: int) -> int:
        """Global index of chunk ``chunk``'s ghost point (its first owned point - 1)."""
        return chunk * self.per_chunk(level)


class Exchange(ABC):
    """What crosses chunk boundaries. Each call is collective over the local chunks.

    ``local_chunks`` lists the chunk indices held by this process, in order.
    """

    local_chunks: Sequence[int]

    @abstractmethod
    def shift(self, lasts: Sequence[State], first: State) -> list[State]:
        """Send each local chunk's last point right; return each chunk's ghost.

        Chunk 0's ghost is ``first`` (point 0, the initial condition).
        """

    @abstractmethod
    def relay(self, fn: Callable[[int, State], State], first: State) -> None:
        """The relay: ``last = fn(chunk, ghost)``, chunk after chunk, left to right,
        each chunk's ghost the last point of the one before."""

    @abstractmethod
    def allreduce_sum(self, value: float) -> float:
        """Sum a scalar over all chunks (only the local partial sum is passed)."""


class LocalExchange(Exchange):
    """All ``chunks`` in one process: shifts are list moves, the relay a loop.

    Example:
        >>> ex = LocalExchange(3)
        >>> ex.shift(["a", "b", "c"], first="x")
        ['x', 'a', 'b']
    """

    def __init__(self, chunks: int) -> None:
        self.local_chunks = list(range(chunks))

    def shift(self, lasts: Sequence[State], first: State) -> list[State]:
        return [first, *lasts[:-1]]

    def relay(self, fn: Callable[[int, State], State], first: State) -> None:
        ghost = first
        for p in self.local_chunks:
            ghost = fn(p, ghost)

    def allreduce_sum(self, value: float) -> float:
        return value
