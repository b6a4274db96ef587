"""Markov-chain building blocks shared by the embedded chain (chain.py) and the continuous-time chain
(continuous.py): the stationary distribution of a row-stochastic matrix, binomial transition tables,
and the checks of the chain's parameters."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from scipy.sparse.csgraph import breadth_first_order
from scipy.stats import binom


def stationary_distribution(P, start: int = 0) -> np.ndarray:
    """Stationary distribution of a row-stochastic matrix (dense array or scipy.sparse), restricted
    to the states reachable from `start` (the others get 0). Solves (P^T - I) pi = 0 with one
    equation replaced by sum(pi) = 1; falls back to power iteration if that system is singular."""
    n = P.shape[0]
    sparse = sp.issparse(P)
    Ps = sp.csr_matrix(P) if sparse else None
    if sparse:
        reach = np.sort(breadth_first_order(Ps, start, directed=True, return_predecessors=False))
    else:
        reach = np.sort(breadth_first_order(sp.csr_matrix((np.asarray(P) > 0).astype(float)), start, directed=True,
                                            return_predecessors=False))
    k = len(reach)
    pi = np.zeros(n)
    if k == 1:
        pi[reach] = 1.0
        return pi
    if sparse:
        Q = Ps[reach][:, reach]
        A = (Q.T - sp.identity(k, format="csr")).tolil()
        A[k - 1, :] = np.ones(k)
        rhs = np.zeros(k)
        rhs[-1] = 1.0
        with np.errstate(all="ignore"):
            x = spla.spsolve(A.tocsc(), rhs)
        ok = np.all(np.isfinite(x))
    else:
        Q = np.asarray(P)[np.ix_(reach, reach)]
        A = Q.T - np.eye(k)
        A[-1, :] = 1.0
        rhs = np.zeros(k)
        rhs[-1] = 1.0
        try:
            x = np.linalg.solve(A, rhs)
            ok = np.all(np.isfinite(x))
        except np.linalg.LinAlgError:
            ok = False
    if ok:
        resid = np.abs(Q.T @ x - x).max()
        ok = resid < 1e-8 and x.min() > -1e-8
    if not ok:  # several closed classes reachable, or numerical trouble: power iteration (Cesaro mean)
        x = _power_iteration(Q if not sparse else Q.tocsr(), k, start_local=int(np.searchsorted(reach, start)))
    x = np.clip(x, 0.0, None)
    pi[reach] = x / x.sum()
    return pi


def _power_iteration(Q, k: int, start_local: int, tol: float = 1e-13, max_iter: int = 200000) -> np.ndarray:
    v = np.zeros(k)
    v[start_local] = 1.0
    acc = np.zeros(k)
    QT = Q.T
    for _ in range(max_iter):
        nv = QT @ v
        acc += nv
        if np.abs(nv - v).sum() < tol:
            return nv
        v = nv
    return acc / max_iter



def binom_table(n: int, p: float) -> np.ndarray:
    """T[m, a] = P(Binomial(m, p) = a) for 0 <= a <= m <= n (0 above the diagonal)."""
    m = np.arange(n + 1)[:, None]
    a = np.arange(n + 1)[None, :]
    with np.errstate(all="ignore"):
        t = binom.pmf(a, m, p)
    t = np.where(a <= m, np.nan_to_num(t), 0.0)
    if p == 0.0:
        t = np.zeros((n + 1, n + 1))
        t[:, 0] = 1.0
    elif p == 1.0:
        t = np.eye(n + 1)
    return t


def check_params(n: int, p: float, alpha: float, q_l: float) -> None:
    if not (isinstance(n, (int, np.integer)) and n >= 1):
        raise ValueError(f"concurrency N must be an integer >= 1, got {n!r}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not 0.0 <= q_l < 1.0:
        raise ValueError(f"q_L must be in [0, 1), got {q_l}")
