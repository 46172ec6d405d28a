r"""MGRIT's relaxation, restriction and correction as pure functions on one chunk's
points of one level.

``u`` is one chunk's points on one level: ``u[0]`` is the ghost (the left neighbour's
last point, or point 0), ``u[1:]`` the owned points; ``offset`` is the ghost's global
index, a multiple of ``cf``, so local and global C/F classification agree. ``f`` is the
right-hand side of ``u_j = \Phi_j(u_{j-1}) + f_j`` (``None`` for ``f = 0``), and
``step(j, u)`` applies ``\Phi_j``. :mod:`leantrain.layer_parallel.mgrit` drives them.
"""

from __future__ import annotations

from collections.abc import Sequence

from leantrain.layer_parallel.ode import State, add, sq_norm, sub

__all__ = ["Rhs", "c_relax", "correct", "f_relax", "restrict", "serial_sweep"]

Rhs = Sequence[State | None] | None


def _plus_rhs(x: State, f: Rhs, i: int) -> State:
    return x if f is None or f[i] is None else add(x, f[i])


def f_relax(step, u: Sequence[State], f: Rhs, offset: int, cf: int) -> list[State]:
    """F-relaxation: ``u_j = Phi(u_{j-1}) + f_j`` at every F-point, in order."""
    u = list(u)
    for i in range(1, len(u)):
        if (offset + i) % cf:
            u[i] = _plus_rhs(step(offset + i, u[i - 1]), f, i)
    return u


def c_relax(step, u: Sequence[State], f: Rhs, offset: int, cf: int):
    """C-relaxation; also returns the squared residual it removed at the C-points
    (a 0-dim tensor on the states' device; 0.0 without C-points)."""
    u, r2 = list(u), 0.0
    for i in range(cf, len(u), cf):
        new = _plus_rhs(step(offset + i, u[i - 1]), f, i)
        r2 += sq_norm(sub(new, u[i]))
        u[i] = new
    return u, r2


def restrict(step_fine, step_coarse, u: Sequence[State], f: Rhs, offset: int, cf: int):
    """Residual at C-points, injection and tau correction: ``(v_c, f_c, ||r||^2)``
    (the last as :func:`c_relax`'s)."""
    v = list(u[::cf])
    fc: list[State | None] = [None]
    r2 = 0.0
    for jc in range(1, len(v)):
        i = jc * cf
        r = sub(_plus_rhs(step_fine(offset + i, u[i - 1]), f, i), u[i])
        r2 += sq_norm(r)
        tau = sub(v[jc], step_coarse(offset // cf + jc, v[jc - 1]))
        fc.append(add(r, tau))
    return v, fc, r2


def serial_sweep(step, ghost: State, f: Rhs, offset: int, n: int) -> list[State]:
    """Plain stepping ``u_j = Phi(u_{j-1}) + f_j`` over ``n`` points after ``ghost``."""
    u = [ghost]
    for i in range(1, n + 1):
        u.append(_plus_rhs(step(offset + i, u[-1]), f, i))
    return u


def correct(u: Sequence[State], uc: Sequence[State], vc: Sequence[State], cf: int):
    """Coarse-grid correction at the C-points: ``u_{J cf} += u^c_J - v_J``."""
    u = list(u)
    for jc in range(1, len(uc)):
        u[jc * cf] = add(u[jc * cf], sub(uc[jc], vc[jc]))
    return u
