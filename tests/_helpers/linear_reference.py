"""MGRIT on the linear test ODE x' = lambda x, written from the definition with numpy.

Independent of leantrain: each component of a diagonal system is its own scalar problem
``A_l u = f`` with ``(A_l u)_0 = u_0`` and ``(A_l u)_j = u_j - phi_l u_{j-1}``,
``phi_l = 1 + cf^l h lambda``. Relaxations are products of elementary matrices acting on
the augmented vector ``[u; 1]`` (the last column carries the right-hand side), the
coarsest level is ``np.linalg.solve``, and the coarse-grid correction is the linear
form of FAS: ``u_C += V(A_{l+1}, R(f - A_l u))`` with a zero initial error.
"""

from __future__ import annotations

import numpy as np


def system(m: int, phi: float) -> np.ndarray:
    a = np.eye(m + 1)
    a[np.arange(1, m + 1), np.arange(m)] = -phi
    return a


def relax(u: np.ndarray, f: np.ndarray, phi: float, points) -> np.ndarray:
    """Apply ``u_j = phi u_{j-1} + f_j`` at ``points`` in order, as matrices."""
    n = len(u)
    t = np.eye(n + 1)
    for j in points:
        r = np.eye(n + 1)
        r[j, j] = 0.0
        r[j, j - 1] = phi
        r[j, n] = f[j]
        t = r @ t
    return (t @ np.append(u, 1.0))[:n]


class LinearMGRIT:
    """Scalar-lambda MGRIT with ``levels``, ``cf``, ``relax`` (sweeps per level)."""

    def __init__(self, lam: float, n: int, h: float, cf: int, levels: int, nu) -> None:
        self.lam, self.n, self.h, self.cf = lam, n, h, cf
        self.levels, self.nu = levels, nu

    def phi(self, level: int) -> float:
        return 1.0 + self.cf**level * self.h * self.lam

    def points(self, level: int, kind: str):
        m = self.n // self.cf**level
        c = kind == "C"
        return [j for j in range(1, m + 1) if (j % self.cf == 0) == c]

    def f(self, u, f, level):
        return relax(u, f, self.phi(level), self.points(level, "F"))

    def c(self, u, f, level):
        return relax(u, f, self.phi(level), self.points(level, "C"))

    def vcycle(self, level: int, u: np.ndarray, f: np.ndarray) -> np.ndarray:
        m = self.n // self.cf**level
        a = system(m, self.phi(level))
        if level == self.levels - 1:
            return np.linalg.solve(a, f)
        for _ in range(self.nu[level]):
            u = self.c(self.f(u, f, level), f, level)
        u = self.f(u, f, level)
        rc = (f - a @ u)[:: self.cf]
        u = u.copy()
        u[:: self.cf] += self.vcycle(level + 1, np.zeros_like(rc), rc)
        return self.f(u, f, level) if level > 0 else u

    def skip_cycle(self, level: int, u: np.ndarray, x0: float) -> np.ndarray:
        m = self.n // self.cf**level
        f = np.zeros(m + 1)
        f[0] = x0
        if level == self.levels - 1:
            return np.linalg.solve(system(m, self.phi(level)), f)
        u = u.copy()
        u[:: self.cf] = self.skip_cycle(level + 1, u[:: self.cf], x0)
        return self.f(u, f, level) if level > 0 else u

    def residual_after_f(self, u: np.ndarray, f: np.ndarray) -> np.ndarray:
        """C-point residuals (j >= cf) of the iterate after one F-relaxation."""
        r = f - system(self.n, self.phi(0)) @ self.f(u, f, 0)
        return r[self.cf :: self.cf]

    def run(self, x0: float, iterations: int, skip: bool):
        """Return (per-cycle C-residual vectors, final C-residual vector, final u)."""
        f = np.zeros(self.n + 1)
        f[0] = x0
        u = f.copy()
        history = []
        for k in range(iterations):
            if skip and k == 0:
                u = self.skip_cycle(0, u, x0)
                continue
            history.append(self.residual_after_f(u, f))
            u = self.vcycle(0, u, f)
        final = self.residual_after_f(u, f)
        u = self.c(self.f(u, f, 0), f, 0)
        return history, final, u


def diagonal_run(lams, x0s, n, h, cf, levels, nu, iterations, skip):
    """Residual norms (history + final) and final states of a diagonal system."""
    runs = [
        LinearMGRIT(lam, n, h, cf, levels, nu).run(x0, iterations, skip)
        for lam, x0 in zip(lams, x0s, strict=True)
    ]
    k = len(runs[0][0])
    hist = [np.sqrt(sum(np.sum(r[0][i] ** 2) for r in runs)) for i in range(k)]
    final = np.sqrt(sum(np.sum(r[1] ** 2) for r in runs))
    u = np.stack([r[2] for r in runs], axis=1)  # (N+1, d)
    return [*hist, final], u
