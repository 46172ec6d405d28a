"""The ``torch.distributed`` :class:`~.layout.Exchange`: one chunk of layers per rank.

Rank ``r`` of the layer-parallel process group owns chunk ``r`` (forward) and adjoint
chunk ``P - 1 - r`` (the adjoint runs the chunks in reversed order, so every rank keeps
its own layers and graphs in both directions). What crosses rank boundaries is exactly
what :class:`~.layout.LocalExchange` moves inside one process:

* ``shift``: each rank's last point goes to its right neighbour, posted together with
  the receive from the left neighbour in one ``batch_isend_irecv``;
* ``relay``: receive the ghost from the left, run the chunk, send the last point
  right (the coarsest level's serial solve, and the exact serial mode);
* ``allreduce_sum``: one float64 ``all_reduce`` per residual norm.

Every wait has a timeout. A rank that fails mid-step (an exception, a killed process)
leaves its neighbours waiting on a receive; they raise :class:`LayerParallelCommError`
naming the operation, the peer and the timeout instead of hanging.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from leantrain.layer_parallel.layout import Exchange
from leantrain.layer_parallel.ode import State, as_tuple, like

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


class LayerParallelCommError(RuntimeError):
    """A layer-parallel send, receive or reduction failed or timed out."""


def _timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds or a timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds}")
    return datetime.timedelta(seconds=seconds)


def collective_device(group=None) -> torch.device:
    """Where a collective's own small buffers (a residual norm, a seed, a flag) go:
    the current CUDA device under NCCL, which reduces device tensors only, else the
    CPU (gloo)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: Sequence[float], group=None) -> list[float]:
    """Element-wise maximum over ``group`` (identity without torch.distributed).

    NaN would poison the maximum; a non-finite value is sent as ``inf``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    finite = [v if math.isfinite(v) else math.inf for v in values]
    t = torch.tensor(finite, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


class DistExchange(Exchange):
    """Boundary states over a ``torch.distributed`` group, one chunk per rank.

    Args:
        group: the layer-parallel process group (None: the default group).
        reverse: chunk order reversed (the adjoint): rank ``r`` holds chunk
            ``P - 1 - r``.
        timeout: seconds (or a timedelta) any wait may take before
            :class:`LayerParallelCommError` is raised.

    Example:
        >>> ex = DistExchange()  # doctest: +SKIP
        >>> ghost = ex.shift([last], first=u0)[0]  # doctest: +SKIP
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        reverse: bool = False,
        timeout: float | datetime.timedelta | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistExchange needs an initialised torch.distributed process group "
                "(torch.distributed.init_process_group, e.g. under torchrun)"
            )
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reverse = bool(reverse)
        self.timeout = _timedelta(timeout)
        self.chunk = self.size - 1 - self.rank if reverse else self.rank
        self.local_chunks = [self.chunk]
        self.device = collective_device(group)

    # ------------------------------------------------------------------ helpers
    def _peer(self, chunk: int) -> int:
        """Global rank that holds ``chunk``."""
        group_rank = self.size - 1 - chunk if self.reverse else chunk
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _wait(self, works, what: str) -> None:
        try:
            for w in works:
                w.wait(self.timeout)
        except Exception as err:  # noqa: BLE001 - re-raised with the context
            raise LayerParallelCommError(
                f"layer-parallel rank {self.rank} (chunk {self.chunk} of "
                f"{self.size}): {what} failed or timed out after "
                f"{self.timeout.total_seconds():.0f} s - did a neighbouring rank "
                f"fail? ({type(err).__name__}: {err})"
            ) from err

    def _send_recv(
        self, send: State | None, to: int | None, recv: State | None, frm: int | None
    ) -> State | None:
        ops, out = [], None
        if recv is not None and frm is not None:
            bufs = [torch.empty_like(t) for t in as_tuple(recv)]
            ops += [
                dist.P2POp(dist.irecv, b, self._peer(frm), self.group) for b in bufs
            ]
            out = like(recv, bufs)
        if send is not None and to is not None:
            ops += [
                dist.P2POp(
                    dist.isend, t.detach().contiguous(), self._peer(to), self.group
                )
                for t in as_tuple(send)
            ]
        if ops:
            what = f"exchange with chunk(s) {frm} <- / -> {to}"
            try:
                works = dist.batch_isend_irecv(ops)
            except Exception as err:  # noqa: BLE001
                raise LayerParallelCommError(
                    f"layer-parallel rank {self.rank}: posting {what} failed: {err}"
                ) from err
            self._wait(works, what)
        return out

    # ---------------------------------------------------------------- Exchange
    def shift(self, lasts: Sequence[State], first: State) -> list[State]:
        c, p = self.chunk, self.size
        right = c + 1 if c + 1 < p else None
        left = c - 1 if c > 0 else None
        ghost = self._send_recv(lasts[0], right, first, left)
        return [first if ghost is None else ghost]

    def relay(self, fn: Callable[[int, State], State], first: State) -> None:
        c = self.chunk
        ghost = first
        if c > 0:
            ghost = self._send_recv(None, None, first, c - 1)
        last = fn(c, ghost)
        if c + 1 < self.size:
            self._send_recv(last, c + 1, None, None)

    def allreduce_sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        try:
            work = dist.all_reduce(t, group=self.group, async_op=True)
        except Exception as err:  # noqa: BLE001
            raise LayerParallelCommError(
                f"layer-parallel rank {self.rank}: residual all_reduce failed: {err}"
            ) from err
        self._wait([work], "residual all_reduce")
        return float(t.item())

    # ------------------------------------------------- per-batch collectives
    def broadcast(self, state: State, src_chunk: int) -> State:
        """``state`` as held by the rank of ``src_chunk``, on every rank."""
        out = [t.detach().clone().contiguous() for t in as_tuple(state)]
        src = self._peer(src_chunk)
        works = []
        try:
            for t in out:
                works.append(dist.broadcast(t, src, group=self.group, async_op=True))
        except Exception as err:  # noqa: BLE001
            raise LayerParallelCommError(
                f"layer-parallel rank {self.rank}: broadcast failed: {err}"
            ) from err
        self._wait(works, f"broadcast from chunk {src_chunk}")
        return like(state, out)

    def broadcast_int(self, value: int, src_chunk: int = 0) -> int:
        """An integer (e.g. a batch seed) as held by the rank of ``src_chunk``."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        t = self.broadcast(t, src_chunk)
        return int(t.item())
