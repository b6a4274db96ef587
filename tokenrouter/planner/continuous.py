"""The throughput model in continuous time: S's steps and L's steps are not aligned.

The chain of tokenrouter.planner.chain counts time in whole S steps: L launches at an S-step
boundary and the requests it returns rejoin S at once. The runtime does neither. Measured on the
latency-model executor (docs/BENCHMARKS.md): S starts its next step the moment the last one ends,
so a request that L returns waits for the S step in progress (about half an S step with separate
devices; a whole one when co-located, since L launches just after S started a step and freezes it);
an idle L launches a hand-off's L step about a millisecond after the S step that sent it; a backlogged
L relaunches the moment its step ends, in the middle of an S step. This chain models exactly that.

State. The phase of S: the share of S's current step already done, on a grid of K points (a
non-grid phase is rounded at random to its two grid neighbours, keeping its mean). Two kinds of
embedded states:
- Idle(x): an S-step boundary, L idle, x < B requests queued at L, nobody waiting to rejoin S.
  S steps its N - x requests; A ~ Binomial(N - x, p) hand off; if x + A >= B, L launches
  `handoff` seconds after the boundary (S meanwhile at phase handoff / t_S), else Idle(x + A).
- Launch(b, R, i): L launches a batch of b at phase i / K; R requests that L returned are waiting
  for S's step in progress, whose batch is therefore N - b - R. During L's t_L(b) seconds S makes
  k(b) = (1 - alpha) t_L(b) / t_S(N - b) steps of progress. At each S boundary the step's
  requests hand off Binomial(batch, p) and the waiting ones join. When L ends, its b requests wait
  for S's step in progress; if q >= B are queued, L relaunches at once: Launch(q, b, phase) (b
  waiting, or b + R if no boundary passed); otherwise S finishes its step at full speed, the
  returns join, and the boundary goes on as Idle (or launches after `handoff`).

Throughput = sum(pi R) / sum(pi T) over the embedded chain (renewal reward), solved exactly as a
scipy.sparse stationary distribution on the states reachable from Idle(0). With handoff = 0 and K
large this is the continuous-time system of tokenrouter.planner.sim (which the tests check).

Approximations: S's steps during an L step take t_S(N - b) (as in the aligned chain); requests L
returns while it relaunches join S at the next boundary even when their message would land just
after it; geometric gaps and one-token visits to L (no spans: use the aligned chain or the
simulator for q_L > 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from tokenrouter.planner.latency import LatencyLike, LatencyModel, as_latency
from tokenrouter.planner.markov import binom_table, check_params, stationary_distribution

__all__ = ["ContinuousSolution", "continuous_curve", "solve_continuous", "DEFAULT_GRID"]

DEFAULT_GRID = 8  # phase points per S step: error below 1% against the simulator (tests), fast at N = 64


@dataclass
class ContinuousSolution:
    n: int
    b: int
    throughput: float  # tokens per second
    l_throughput: float  # of which written by L
    l_busy: float  # share of time L is running
    mean_l_batch: float
    states: int  # reachable embedded states


def _split(u: float) -> tuple[int, float]:
    """Grid point below u and the weight of the one above (random rounding that keeps the mean)."""
    lo = math.floor(u + 1e-9)
    f = u - lo
    return lo, (0.0 if f < 1e-9 else f)


@dataclass
class _Flight:
    """Per launch size b: where q stands after j S boundaries, for each R (B-independent)."""

    m: int  # requests outside L's batch
    lo: int  # k(b) K rounded down
    g: float  # weight of lo + 1
    dists: dict[int, np.ndarray]  # j -> (R, q) probabilities after j boundaries
    s_tokens: dict[int, np.ndarray]  # j -> (R,) expected S tokens over those j boundaries
    kernel: np.ndarray  # (q, q'): one S step with batch m - q


class _Model:
    """Everything for one N that does not depend on the threshold B."""

    def __init__(self, n: int, p: float, lat_s: LatencyModel, lat_l: LatencyModel, alpha: float, handoff: float,
                 grid: int, keep: float) -> None:
        self.n, self.p, self.grid, self.handoff, self.keep = n, p, grid, handoff, keep
        self.table = binom_table(n, p)
        self.ts = np.array([lat_s(max(m, 1)) for m in range(n + 1)])
        self.ts[0] = 0.0  # no S step in progress: nothing to wait for
        self.tl = np.array([0.0] + [lat_l(b) for b in range(1, n + 1)])
        if handoff >= self.ts[1:].min():
            raise ValueError(f"hand-off latency {handoff} s must be below the S step ({self.ts[1:].min()} s)")
        # launch phase after an idle boundary with x queued (S stepping its N - x meanwhile)
        phase = [_split(handoff / self.ts[n - x] * grid) if x < n else (0, 0.0) for x in range(n + 1)]
        self.launch_lo = np.array([lo for lo, _ in phase])
        self.launch_f = np.array([f for _, f in phase])
        self.flights: dict[int, _Flight] = {}
        for b in range(1, n + 1):
            m = n - b
            k = (1.0 - alpha) * self.tl[b] / self.ts[m] if m > 0 else 0.0
            lo, g = _split(k * grid)
            q = np.arange(m + 1)
            kernel = np.zeros((m + 1, m + 1))
            for qq in range(m + 1):
                kernel[qq, qq:] = self.table[m - qq, :m - qq + 1]
            first = np.zeros((m + 1, m + 1))  # row R: the step in progress has m - R requests
            for r in range(m + 1):
                first[r, :m - r + 1] = self.table[m - r, :m - r + 1]
            w = (m - q) * keep
            js = sorted({(i + lo + c) // grid for i in range(grid) for c in (0, 1)} - {0})
            dists, toks = {}, {}
            d, tok = first, (m - q) * keep  # after boundary 1; q indexes R here
            for j in range(1, (js[-1] if js else 0) + 1):
                if j > 1:
                    tok = tok + d @ w
                    d = d @ kernel
                if j in js:
                    dists[j], toks[j] = d, tok
            self.flights[b] = _Flight(m, lo, g, dists, toks, kernel)

    def _after_l(self, B: int, b: int, d: np.ndarray, wc: float, src: np.ndarray, i2: np.ndarray, left: np.ndarray,
                 at_boundary: bool, offset: np.ndarray, rows: list, cols: list, vals: list, reward: np.ndarray,
                 time: np.ndarray, launch_targets) -> None:
        """Transitions when L's step on b ends with q queued (distribution d over q, per R row) at
        phases i2 of S's step: relaunch if q >= B, else S finishes its step and the returns join."""
        K, keep, h = self.grid, self.keep, self.handoff
        fl = self.flights[b]
        m = fl.m
        n_i = src.shape[1]
        if B <= m:  # relaunch at once with b waiting for S's step (none waiting at a boundary)
            qs = np.arange(B, m + 1)
            pr = np.broadcast_to((d[:, B:] * wc)[:, None, :], (m + 1, n_i, len(qs)))
            waiting = 0 if at_boundary else b
            tgt = np.broadcast_to(offset[qs][None, None, :] + waiting * K + i2[None, :, None], pr.shape)
            rows.append(np.broadcast_to(src[:, :, None], pr.shape).ravel())
            cols.append(tgt.ravel()), vals.append(pr.ravel())
        dq = d[:, :min(B, m + 1)]  # L stays idle
        if at_boundary:  # Idle(q) now
            s_idx = np.broadcast_to(src[:, :, None], (m + 1, n_i, dq.shape[1]))
            pr = np.broadcast_to((dq * wc)[:, None, :], s_idx.shape)
            tgt = np.broadcast_to(np.arange(dq.shape[1])[None, None, :], s_idx.shape)
            rows.append(s_idx.ravel()), cols.append(tgt.ravel()), vals.append(pr.ravel())
            return
        mq = m - np.arange(dq.shape[1])  # S finishes its step of m - q, then the returns join
        reward[src] += wc * (dq @ (mq * keep))[:, None]
        time[src] += wc * (dq @ self.ts[mq])[:, None] * left[None, :]
        xd = np.zeros((m + 1, self.n + 1))
        xd[:, :m + 1] = dq @ fl.kernel[:dq.shape[1]]
        src_all = src.ravel()
        time[src_all] += h * launch_targets(src_all, np.repeat(xd * wc, n_i, axis=0))

    def solve(self, B: int) -> ContinuousSolution:
        n, keep, K, h = self.n, self.keep, self.grid, self.handoff
        launch_lo, launch_f = self.launch_lo, self.launch_f
        sizes = np.array([(n - b + 1) * K if b >= B else 0 for b in range(n + 1)])
        offset = B + np.concatenate([[0], np.cumsum(sizes)[:-1]])  # Launch(b, R, i) = offset[b] + R K + i
        count = int(B + sizes.sum())
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        reward = np.zeros(count)
        tokens_l = np.zeros(count)
        l_time = np.zeros(count)
        time = np.zeros(count)
        batch = np.zeros(count)

        def launch_targets(src: np.ndarray, xdist: np.ndarray) -> np.ndarray:
            """Rows `src` (one per xdist row) reach x: Idle(x) for x < B, else Launch(x, 0, handoff phase).
            Returns the probability of launching, per row."""
            s_idx = np.broadcast_to(src[:, None], xdist.shape)
            xs = np.broadcast_to(np.arange(xdist.shape[1])[None, :], xdist.shape)
            idle = (xs < B) & (xdist > 0)
            rows.append(s_idx[idle]), cols.append(xs[idle]), vals.append(xdist[idle])
            go = (xs >= B) & (xdist > 0)
            x_go, pr_go = xs[go], xdist[go]
            for ph, wt in ((launch_lo[x_go], 1.0 - launch_f[x_go]), (launch_lo[x_go] + 1, launch_f[x_go])):
                keep = wt > 0
                rows.append(s_idx[go][keep]), cols.append(offset[x_go[keep]] + np.minimum(ph[keep], K - 1))
                vals.append(pr_go[keep] * wt[keep])
            return (xdist * (xs >= B)).sum(axis=1)

        # Idle(x): one S step of N - x requests
        xi = np.arange(B)
        xdist = np.zeros((B, n + 1))
        for x in range(B):
            xdist[x, x:] = self.table[n - x, :n - x + 1]
        reward[:B] = (n - xi) * keep
        time[:B] = self.ts[n - xi] + h * launch_targets(xi, xdist)

        # Launch(b, R, i)
        for b in range(B, n + 1):
            fl = self.flights[b]
            m = fl.m
            base = offset[b]
            R = np.arange(m + 1)
            states = base + R[:, None] * K + np.arange(K)[None, :]  # (R, i)
            reward[states] = b
            tokens_l[states] = b
            time[states] = self.tl[b]
            l_time[states] = self.tl[b]
            batch[states] = b
            if m == 0:  # S has no requests: L's requests rejoin at once
                rows.append(states.ravel()), cols.append(np.zeros(K, dtype=np.int64)), vals.append(np.ones(K))
                continue
            for c, wc in ((0, 1.0 - fl.g), (1, fl.g)):
                if wc <= 0:
                    continue
                e = np.arange(K) + fl.lo + c
                j_of, i2_of = e // K, e % K
                for j in np.unique(j_of):
                    ii = np.nonzero(j_of == j)[0]
                    i2 = i2_of[ii]
                    src = states[:, ii]  # (R, |ii|)
                    left = 1.0 - i2 / K  # share of S's step in progress still to run
                    if j == 0:  # no boundary during L's step: q = 0 < B, R and b wait for the step of m - R
                        mc = m - R
                        xd = np.zeros((m + 1, n + 1))
                        for r in range(m + 1):
                            xd[r, :mc[r] + 1] = self.table[mc[r], :mc[r] + 1]
                        xd_all = np.repeat(xd * wc, len(ii), axis=0)
                        src_all = src.ravel()
                        reward[src_all] += wc * np.repeat(mc * keep, len(ii))
                        time[src_all] += wc * (self.ts[mc][:, None] * left[None, :]).ravel()
                        time[src_all] += h * launch_targets(src_all, xd_all)
                        continue
                    d = fl.dists[j]  # (R, q)
                    reward[src] += wc * fl.s_tokens[j][:, None]
                    # L ends exactly at an S boundary (its phase rounded up onto it, or exact): the
                    # returns join the step that starts there, as in continuous time
                    now = (i2 == 0) & (c == 1 or fl.g == 0)
                    for at_boundary in (True, False):
                        cols_sel = np.nonzero(now == at_boundary)[0]
                        if len(cols_sel):
                            self._after_l(B, b, d, wc, src[:, cols_sel], i2[cols_sel], left[cols_sel],
                                          at_boundary, offset, rows, cols, vals, reward, time, launch_targets)
        P = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(count, count))
        P.sum_duplicates()
        pi = stationary_distribution(P, start=0)
        t_total = float(pi @ time)
        launches = float(pi[B:].sum())
        return ContinuousSolution(
            n=n, b=B, throughput=float(pi @ reward) / t_total, l_throughput=float(pi @ tokens_l) / t_total,
            l_busy=float(pi @ l_time) / t_total,
            mean_l_batch=float(pi @ batch) / launches if launches > 0 else 0.0, states=int((pi > 0).sum()))


def _model(n: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float, handoff: float,
           grid: int, keep: float | None) -> _Model:
    check_params(n, p, alpha, 0.0)
    keep = 1.0 - p if keep is None else keep
    if not 0.0 <= keep <= 1.0 - p + 1e-12:
        raise ValueError(f"tokens kept per S step and request must be in [0, 1 - p], got {keep}")
    if not (isinstance(grid, (int, np.integer)) and grid >= 1):
        raise ValueError(f"phase grid must be an integer >= 1, got {grid!r}")
    if handoff < 0:
        raise ValueError(f"hand-off latency must be >= 0 seconds, got {handoff}")
    return _Model(int(n), p, as_latency(lat_s), as_latency(lat_l), alpha, handoff, int(grid), keep)


def solve_continuous(n: int, b: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *,
                     handoff: float = 0.0, grid: int = DEFAULT_GRID, keep: float | None = None) -> ContinuousSolution:
    """The continuous-time chain for N = n requests and launch threshold B = b. `keep`: the tokens an
    S step yields per request (default 1 - p: the ones it does not hand off; see chain.py's
    `answered` for why it can be less)."""
    if not 1 <= b <= n:
        raise ValueError(f"threshold B must be in 1..N={n}, got {b}")
    return _model(n, p, lat_s, lat_l, alpha, handoff, grid, keep).solve(int(b))


def continuous_curve(n: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *,
                     handoff: float = 0.0, grid: int = DEFAULT_GRID,
                     keep: float | None = None) -> list[ContinuousSolution]:
    """Solutions for every threshold B = 1..n (element B - 1)."""
    model = _model(n, p, lat_s, lat_l, alpha, handoff, grid, keep)
    return [model.solve(B) for B in range(1, n + 1)]
