"""The delayed-batching throughput model of docs/DESIGN.md section 5: a Markov chain, solved exactly.

The system
----------
A closed system of N concurrent requests and two subservers, S (small model) and L (large model).
Every request is in one of three places: at S (decoding there), queued at L, or in the batch that L
is running. Nothing else exists: a request that finishes is replaced at once by a new one at S, and
prefill is not modelled.

- S runs all its requests as one batch per step. After each S step, each of those requests is handed
  to L with probability p, independently (so the number of S steps between two hand-offs is
  geometric with mean 1/p). A handed-off request's S token is dropped (L writes that position), so
  an S step emits one token per request that stays at S: A ~ Binomial(n_S, p) requests leave, and
  S emits n_S - A tokens.
- L launches a batch only when it is idle and at least B requests are queued (B <= N, so the launch
  rule is "q >= min(B, requests that could be at L)": with every request queued, q = N >= B and L
  launches; the rule cannot deadlock). A launch takes every queued request (no cap on L's batch).
- An L step on a batch of b takes t_L(b) seconds and emits b tokens. Each of the b requests then
  goes back to S, or, with the span extension (R-Stitch: L keeps a request for a geometric number
  of tokens), stays at L with continuation probability q_L and rejoins L's queue. q_L = 0 is the
  plain token-level model of docs/DESIGN.md section 5.
- S steps on a batch of m take t_S(m) seconds. r(b) = t_L(b) / t_S(N - b) is the length of an L
  step counted in S steps of the batch S has when L launches.

Placement: the interference parameter alpha in [0, 1]. While L runs, S progresses at rate 1 - alpha:
during an L step of t_L(b) seconds, S completes k(b) = (1 - alpha) * t_L(b) / t_S(N - b) steps,
deterministically (time dilation, not random stalls). alpha = 0: separate devices, S completes r(b)
steps per L step. alpha = 1: serialised on one device, S makes no progress while L runs (the
semi-Markov chain of docs/DESIGN.md section 5: an L launch takes t_L(b) during which S is frozen). In between it
models MPS-style sharing where S steps take 1 / (1 - alpha) times longer while L runs. L's own
latency t_L(b) is the one measured under that placement (L is not slowed further by S). A
non-integer k(b) is rounded at random to floor or ceil with the probabilities that keep its mean
exact (at alpha = 0 with a non-integer r(b), this also stands in for the S step that straddles L's
return).

The chain
---------
docs/DESIGN.md section 5 states the chain at every S-step boundary with state (q, b, c): queued at L, size of L's
batch in flight, S steps left until it returns. `full_chain` builds exactly that chain as a
scipy.sparse matrix (constant t_S, integer r(b) and integer (1 - alpha) r(b)); it is the reference.
`solve` and `throughput_curve` solve the same chain faster and more generally through its embedded
semi-Markov chain at the moments L is idle: x = number queued at L (0..N) when L has just become
idle or after an S step with L idle. From x:

- x < B (L stays idle): one S step of t_S(N - x) seconds: x -> x + Binomial(N - x, p), reward
  (N - x)(1 - p) tokens;
- x >= B: launch b = x. L runs t_L(b) seconds; meanwhile S completes k(b) steps starting from an
  empty queue, q -> q + Binomial(N - b - q, p) per step, rewarding (N - b - q)(1 - p) tokens each;
  L then returns b tokens and Binomial(b, q_L) of its requests stay queued: x' = q + Binomial(b, q_L).

Throughput = (sum_x pi_x R_x) / (sum_x pi_x T_x) tokens per second (renewal reward), pi the
stationary distribution of the embedded chain (dense solve of (P^T - I) pi = 0 with sum(pi) = 1, on
the states reachable from x = 0, i.e. the start with every request at S). The embedded and full
chains give the same throughput where both apply (tests check it to 1e-9). With state-dependent S
latency, idle S steps use the exact t_S(N - x); S steps during an L step use t_S(N - b), the S batch
at launch (the requests that leave S during the L step would make S's later steps slightly faster).

Zero-wait bound: N * (1 - p + p m_L) / (t_S + p m_L t_L) tokens/s with m_L = 1 / (1 - q_L) the
mean span on L (N / (t_S + p t_L) for q_L = 0): each request's own chain of steps with no waiting.
With batch-dependent latencies t_S and t_L are each model's fastest step over batches 1..N, so the
bound is a true ceiling of the chain.

What the chain does not cover
-----------------------------
- Non-geometric gaps between hand-offs. The chain keeps no per-request age, so it only knows the
  mean gap (p = 1 / (1 + mean gap in tokens)). Run lengths read off a step trace are tested against
  the geometric assumption by `tokenrouter.planner.gaps.fit_runs`; a measured gap histogram is run
  exactly (in distribution, with the runtime's costs per request) by the Monte Carlo simulator
  `tokenrouter.planner.sim.simulate`, which reports the difference; the exact chain would need
  per-request phases (a phase-type gap with m phases makes the S population a vector of m counts,
  C(N + m - 1, m - 1) states per queue length). Bursty gaps
  matter: gaps half 0 and half 18 tokens (mean 9, p = 0.1) at N = 8, r = 4, alpha = 1 give a best
  B of 4 in the simulator against 5 in the chain, and throughput up to 25 % apart at large B.
- Spans on L are covered only as geometric (q_L); a span-length histogram is covered by the
  simulator only.
- Three or more models. The state would be a queue, a batch in flight and a countdown per model,
  plus a routing matrix between models (p_ij), one threshold per model (B becomes a vector, and the
  search is over a grid) and an interference matrix (alpha_ij between every pair that shares
  devices). With two or more slow models in flight at once there is no moment at which all but S
  are idle, so the embedded chain used here does not apply; the full chain's state space is the
  product of the per-model spaces (about (N^2 r / 2)^k for k slow models). Not a chain here:
  `tokenrouter.planner.group_sim` simulates that system and searches the threshold vectors.
- Prefill, request arrival and finish (the system is closed, with N fixed), KV-cache capacity,
  a cap on L's batch, the S-to-L transfer time, and randomness in step latency.
- S's step latency in the chain is taken at its batch at launch during L steps (see above); the
  chain never makes S wait for L's batch to return before it steps (the asynchronous runtime).
- Misalignment of S and L steps: this chain lets the requests L returns rejoin S at once, while in
  the runtime S is mid-step and they wait for its next one (about half an S step on separate
  devices, a whole one co-located), and it has no hand-off latency or runtime overhead. Measured
  on the latency-model executor this put its predictions 12-31 % high. `throughput_curve`, `plan`
  and `best_thresholds` with `overheads` (tokenrouter.planner.overheads) use the continuous-time
  chain of tokenrouter.planner.continuous instead, which models all of that.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from scipy.stats import binom

from tokenrouter.planner.continuous import continuous_curve
from tokenrouter.planner.latency import LatencyLike, LatencyModel, as_latency
from tokenrouter.planner.markov import binom_table, check_params, stationary_distribution
from tokenrouter.planner.overheads import Overheads

__all__ = [
    "Solution", "PlanRow", "FullChain", "solve", "throughput", "throughput_curve", "best_thresholds",
    "plan", "zero_wait_bound", "full_chain", "stationary_distribution", "gaps_to_p",
]


# ---------------------------------------------------------------------------------------------------
# the embedded chain (fast path)


def _kernel(m_max: int, table: np.ndarray) -> np.ndarray:
    """One S step with m_max requests outside L's batch: K[q, q + a] = P(Binomial(m_max - q, p) = a)."""
    size = m_max + 1
    q = np.arange(size)[:, None]
    j = np.arange(size)[None, :]
    a = j - q
    valid = a >= 0
    K = np.zeros((size, size))
    K[valid] = table[(m_max - q + 0 * j)[valid], a[valid]]
    return K


@dataclass
class _Embedded:
    """Per-N pieces of the embedded chain that do not depend on the threshold B."""

    n: int
    p: float
    alpha: float
    q_l: float
    idle_P: np.ndarray  # (n+1, n+1): row x = next-x distribution after one idle S step
    idle_R: np.ndarray  # tokens of that step
    idle_T: np.ndarray  # seconds of that step
    flight_P: np.ndarray  # row b = next-x distribution after an L step on batch b (row 0 unused)
    flight_R: np.ndarray  # tokens during that L step (b from L plus S's tokens)
    flight_S: np.ndarray  # of which S tokens
    flight_T: np.ndarray  # seconds (t_L(b))
    flight_k: np.ndarray  # S steps completed during the L step (mean)

    def matrices(self, B: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = self.n
        P = np.empty((n + 1, n + 1))
        P[:B] = self.idle_P[:B]
        P[B:] = self.flight_P[B:]
        R = np.concatenate([self.idle_R[:B], self.flight_R[B:]])
        T = np.concatenate([self.idle_T[:B], self.flight_T[B:]])
        return P, R, T


def _build_embedded(n: int, p: float, lat_s: LatencyModel, lat_l: LatencyModel, alpha: float,
                    q_l: float, keep: float | None = None) -> _Embedded:
    """`keep`: the tokens an S step yields per request (default 1 - p; `answered` below)."""
    keep = 1.0 - p if keep is None else keep
    table = binom_table(n, p)
    xs = np.arange(n + 1)
    idle_P = np.zeros((n + 1, n + 1))
    for x in range(n + 1):
        m = n - x
        idle_P[x, x:x + m + 1] = table[m, :m + 1]
    idle_R = (n - xs) * keep
    idle_T = np.array([lat_s(max(n - x, 1)) for x in xs])

    flight_P = np.zeros((n + 1, n + 1))
    flight_R = np.zeros(n + 1)
    flight_S = np.zeros(n + 1)
    flight_T = np.zeros(n + 1)
    flight_k = np.zeros(n + 1)
    flight_P[0, 0] = 1.0  # unused (B >= 1)
    for b in range(1, n + 1):
        m_max = n - b
        t_l = lat_l(b)
        k = (1.0 - alpha) * t_l / lat_s(m_max) if m_max > 0 else 0.0
        k_lo = int(math.floor(k + 1e-9))
        f = k - k_lo
        if f < 1e-9:
            f = 0.0
        v = np.zeros(m_max + 1)
        v[0] = 1.0
        s_tok = 0.0
        if m_max > 0 and (k_lo > 0 or f > 0) and p > 0:
            K = _kernel(m_max, table)
            w = (m_max - np.arange(m_max + 1)) * keep
            for _ in range(k_lo):
                s_tok += v @ w
                v = v @ K
            if f > 0:
                s_tok += f * (v @ w)
                v = (1.0 - f) * v + f * (v @ K)
        elif m_max > 0:  # p == 0 (nothing leaves S) or no S steps
            s_tok = k * m_max * keep
        if q_l > 0:
            v = np.convolve(v, binom.pmf(np.arange(b + 1), b, q_l))
        else:
            v = np.concatenate([v, np.zeros(b)])
        flight_P[b] = v / v.sum()
        flight_S[b] = s_tok
        flight_R[b] = s_tok + b
        flight_T[b] = t_l
        flight_k[b] = k
    return _Embedded(n, p, alpha, q_l, idle_P, idle_R, idle_T, flight_P, flight_R, flight_S, flight_T,
                     flight_k)


@dataclass
class Solution:
    """The solved chain for one (N, B): throughput and what the stationary distribution says."""

    n: int
    b: int
    p: float
    alpha: float
    q_l: float
    throughput: float  # tokens per second, S + L
    s_throughput: float  # tokens per second written by S
    l_throughput: float  # tokens per second written by L
    l_busy: float  # share of time L is running
    mean_l_batch: float  # mean batch per L launch
    pi: np.ndarray  # stationary distribution of the embedded chain over x = 0..N (queued at L)
    time_share: np.ndarray  # share of time spent in each embedded state


def _solve_from(emb: _Embedded, B: int) -> Solution:
    n = emb.n
    if not 1 <= B <= n:
        raise ValueError(f"threshold B must be in 1..N={n}, got {B}")
    P, R, T = emb.matrices(B)
    pi = stationary_distribution(P, start=0)
    time_total = float(pi @ T)
    thr = float(pi @ R) / time_total
    flight = np.arange(n + 1) >= B
    l_tok = float(pi[flight] @ np.arange(n + 1)[flight]) / time_total
    launches = float(pi[flight].sum())
    return Solution(
        n=n, b=B, p=emb.p, alpha=emb.alpha, q_l=emb.q_l, throughput=thr, s_throughput=thr - l_tok,
        l_throughput=l_tok, l_busy=float(pi[flight] @ T[flight]) / time_total,
        mean_l_batch=(float(pi[flight] @ np.arange(n + 1)[flight]) / launches) if launches > 0 else 0.0,
        pi=pi, time_share=pi * T / time_total,
    )


def solve(n: int, b: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *,
          q_l: float = 0.0) -> Solution:
    """Solve the chain for N = n requests and launch threshold B = b."""
    check_params(n, p, alpha, q_l)
    return _solve_from(_build_embedded(int(n), p, as_latency(lat_s), as_latency(lat_l), alpha, q_l), int(b))


def throughput(n: int, b: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *,
               q_l: float = 0.0) -> float:
    """Tokens per second of N = n requests with launch threshold B = b."""
    return solve(n, b, p, lat_s, lat_l, alpha, q_l=q_l).throughput


def throughput_curve(n: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *,
                     q_l: float = 0.0, overheads: Overheads | None = None, answered: float = 0.0) -> np.ndarray:
    """Tokens per second for every threshold B = 1..n (element B - 1).

    With overheads, the continuous-time chain of tokenrouter.planner.continuous on the latencies the
    runtime sees (catch-up tokens and per-step overheads added, hand-off latency); without one, this
    module's step-aligned chain (docs/DESIGN.md section 5 as written).

    `answered`: the share of S's hand-offs that L's look-ahead answers (docs/DESIGN.md section 3: a
    request that comes straight back after L's token finds its next token sampled, with no queue and
    no step). Such a hand-off never reaches L's queue, so the chain thins the hand-offs to
    p (1 - answered); the request misses the S step that started while its answer travelled, so an S
    step still yields 1 - p tokens per request (the answered token stands in for the missed step's);
    and the look-ahead rows ride on L's steps as rows of its batch: each queued visit's own last
    token (its catch-up a token less) and the row behind each answered token, 1 / (1 - answered)
    rows per queued visit. A first-order model (the chain keeps no per-request state; every row is
    taken to ride): docs/BENCHMARKS.md, "Look-ahead in the throughput model", measures it.
    """
    return np.array([s.throughput for s in _solutions(n, p, lat_s, lat_l, alpha, q_l, overheads, answered)])


def _solutions(n: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float, q_l: float,
               overheads: Overheads | None, answered: float) -> list:
    """The solved chain for every B = 1..n: the continuous-time one with overheads, else the step-aligned."""
    check_params(n, p, alpha, q_l)
    if not 0.0 <= answered < 1.0:
        raise ValueError(f"answered share must be in [0, 1), got {answered}")
    missed = 1.0 + p * answered  # S steps per decision: an answered one also misses the next step
    p_queued, keep = p * (1.0 - answered) / missed, (1.0 - p * (1.0 - answered)) / missed
    if overheads is not None:
        if q_l > 0:
            raise ValueError("the continuous-time chain covers one-token visits to L only (q_L = 0); "
                             "plan spans without overheads, or with the simulator")
        # catch-up per queued visit: the S tokens of a decision's share p (1 - answered) that queues
        t_s, t_l = overheads.step_latencies(lat_s, lat_l, p * (1.0 - answered), q_l,
                                            riding=1.0 / (1.0 - answered) if answered > 0 else 0.0)
        return continuous_curve(int(n), p_queued, t_s, t_l, alpha, handoff=overheads.handoff, keep=keep)
    emb = _build_embedded(int(n), p_queued, as_latency(lat_s), as_latency(lat_l), alpha, q_l, keep)
    return [_solve_from(emb, B) for B in range(1, n + 1)]


def _pick(curve: np.ndarray, min_gain: float) -> int:
    best = float(curve.max())
    ok = np.nonzero(curve >= best / (1.0 + min_gain) - 1e-12 * best)[0]
    return int(ok[0]) + 1


def best_thresholds(n_max: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *,
                    q_l: float = 0.0, min_gain: float = 0.0, overheads: Overheads | None = None,
                    answered: float = 0.0) -> dict[int, int]:
    """The launch threshold B for L that maximises throughput, for every concurrency N = 1..n_max.

    Returns {N: B}. With min_gain > 0 the smallest B whose throughput is within a factor
    (1 + min_gain) of the best is chosen (so eager launching, B = 1, wins unless waiting pays).
    """
    if not (isinstance(n_max, (int, np.integer)) and n_max >= 1):
        raise ValueError(f"n_max must be an integer >= 1, got {n_max!r}")
    lat_s, lat_l = as_latency(lat_s), as_latency(lat_l)
    return {n: _pick(throughput_curve(n, p, lat_s, lat_l, alpha, q_l=q_l, overheads=overheads, answered=answered),
                     min_gain) for n in range(1, n_max + 1)}


def zero_wait_bound(n: int, p: float, lat_s: LatencyLike, lat_l: LatencyLike, *, q_l: float = 0.0) -> float:
    """N * (1 - p + p m) / (t_S + p m t_L) tokens/s, m = 1 / (1 - q_L): N / (t_S + p t_L) for q_L = 0.

    t_S and t_L are each model's fastest step over batches 1..N (the constants, for constant latency).
    """
    lat_s, lat_l = as_latency(lat_s), as_latency(lat_l)
    t_s = min(lat_s(b) for b in range(1, n + 1))
    t_l = min(lat_l(b) for b in range(1, n + 1))
    m = 1.0 / (1.0 - q_l)
    return n * (1.0 - p + p * m) / (t_s + p * m * t_l)


def gaps_to_p(hist: dict[int, float] | Sequence[Sequence[float]]) -> float:
    """p of the geometric gap with the same mean as a histogram {gap: count}.

    A gap is the number of tokens S writes for a request between getting it (at start or back from
    L) and handing it to L; geometric gaps have mean (1 - p) / p, so p = 1 / (1 + mean gap).
    """
    items = list(hist.items()) if isinstance(hist, dict) else [tuple(x) for x in hist]
    g = np.array([float(k) for k, _ in items])
    w = np.array([float(c) for _, c in items])
    if len(g) == 0 or w.sum() <= 0 or (w < 0).any() or (g < 0).any():
        raise ValueError("a gap histogram needs gaps >= 0 and non-negative counts with a positive sum")
    return 1.0 / (1.0 + float((g * w).sum() / w.sum()))


# ---------------------------------------------------------------------------------------------------
# planning over several N


@dataclass
class PlanRow:
    n: int
    p: float
    alpha: float
    q_l: float
    throughput: list[float]  # tokens/s for B = 1..n
    best_b: int
    best_throughput: float
    gain_over_b1: float  # best / B=1
    zero_wait_bound: float
    solve_s: float  # seconds to build and solve all B for this N
    l_busy: list[float] = field(default_factory=list)  # share of time L runs, per B
    mean_l_batch: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "n": self.n, "p": self.p, "alpha": self.alpha, "q_l": self.q_l,
            "throughput": self.throughput, "best_b": self.best_b, "best_throughput": self.best_throughput,
            "gain_over_b1": self.gain_over_b1, "zero_wait_bound": self.zero_wait_bound,
            "best_over_bound": self.best_throughput / self.zero_wait_bound, "l_busy": self.l_busy,
            "mean_l_batch": self.mean_l_batch, "solve_s": self.solve_s,
        }


def plan(n_values: Sequence[int], p: float, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *,
         q_l: float = 0.0, min_gain: float = 0.0, overheads: Overheads | None = None,
         answered: float = 0.0) -> list[PlanRow]:
    """Throughput for every B = 1..N and the best B, for each N in n_values (with overheads: the
    continuous-time chain; `answered`: look-ahead's share; see throughput_curve)."""
    lat_s, lat_l = as_latency(lat_s), as_latency(lat_l)
    rows = []
    for n in n_values:
        t0 = time.perf_counter()
        sols = _solutions(n, p, lat_s, lat_l, alpha, q_l, overheads, answered)
        dt = time.perf_counter() - t0
        curve = np.array([s.throughput for s in sols])
        best = _pick(curve, min_gain)
        rows.append(PlanRow(
            n=int(n), p=p, alpha=alpha, q_l=q_l, throughput=[float(v) for v in curve], best_b=best,
            best_throughput=float(curve[best - 1]), gain_over_b1=float(curve[best - 1] / curve[0]),
            zero_wait_bound=zero_wait_bound(int(n), p, lat_s, lat_l, q_l=q_l), solve_s=dt,
            l_busy=[s.l_busy for s in sols], mean_l_batch=[s.mean_l_batch for s in sols],
        ))
    return rows


# ---------------------------------------------------------------------------------------------------
# the full (q, b, c) chain of docs/DESIGN.md section 5, as a scipy.sparse matrix (reference)


@dataclass
class FullChain:
    """The chain at every S-step boundary; time unit = one S step; `reward` = expected tokens per unit."""

    n: int
    b: int
    P: sp.csr_matrix
    states: np.ndarray  # (k, 3): q, b_in_flight, c (steps left; 0 = L idle)
    reward: np.ndarray

    def stationary(self) -> np.ndarray:
        return stationary_distribution(self.P, start=0)  # state 0 is (0, 0, 0): all requests at S

    def throughput_per_step(self, pi: np.ndarray | None = None) -> float:
        pi = self.stationary() if pi is None else pi
        return float(pi @ self.reward)


def full_chain(n: int, B: int, p: float, r, alpha: float = 0.0, *, q_l: float = 0.0) -> FullChain:
    """Build the (q, b, c) chain for constant t_S (the unit), L steps of r(b) units (an int, or a
    callable b -> int), S stepping during L's flight on (1 - alpha) r(b) of its r(b) units (at elapsed
    unit t iff floor((t + 1)(1 - alpha)) > floor(t (1 - alpha))). Equal to the embedded chain when
    every (1 - alpha) r(b) is an integer."""
    check_params(n, p, alpha, q_l)
    if not 1 <= B <= n:
        raise ValueError(f"threshold B must be in 1..N={n}, got {B}")
    r_of = (lambda b: r) if not callable(r) else r
    rs = {}
    for b in range(B, n + 1):
        rb = r_of(b)
        if abs(rb - round(rb)) > 1e-9 or round(rb) < 1:
            raise ValueError(f"full_chain needs integer r(b) >= 1, got r({b}) = {rb}")
        rs[b] = int(round(rb))
    rmax = max(rs.values())
    # index the states: idle (q, 0, 0) for q < B first (state 0 = (0, 0, 0)), then busy (q, b, c)
    idx = -np.ones((n + 1, n + 1, rmax + 1), dtype=np.int64)
    states = [(q, 0, 0) for q in range(B)]
    for q in range(B):
        idx[q, 0, 0] = q
    for b in range(B, n + 1):
        for c in range(1, rs[b] + 1):
            for q in range(n - b + 1):
                idx[q, b, c] = len(states)
                states.append((q, b, c))
    states_a = np.array(states, dtype=np.int64)
    k = len(states)
    table = binom_table(n, p)
    span = {b: (binom.pmf(np.arange(b + 1), b, q_l) if q_l > 0 else np.eye(1, b + 1)[0]) for b in range(1, n + 1)}
    rows, cols, vals = [], [], []
    reward = np.zeros(k)

    def idle_target(v: np.ndarray) -> np.ndarray:
        """State index of 'L just became idle (or stayed idle) with v queued' (after the launch check)."""
        out = np.empty_like(v)
        launch = v >= B
        out[~launch] = idx[v[~launch], 0, 0]
        lv = v[launch]
        out[launch] = idx[0, lv, np.array([rs[int(x)] for x in lv], dtype=np.int64)] if lv.size else lv
        return out

    def s_step(src: np.ndarray, q: np.ndarray, m: np.ndarray):
        """Arrivals of one S step: (source, q + a, prob) for a = 0..m."""
        a = np.arange(n + 1)[None, :]
        mask = a <= m[:, None]
        pr = table[m[:, None] + 0 * a, a]
        s = np.broadcast_to(src[:, None], mask.shape)[mask]
        return s, (q[:, None] + a)[mask], pr[mask]

    # idle states
    qi = np.arange(B)
    src = qi.copy()
    s, q1, pr = s_step(src, qi, n - qi)
    rows.append(s), cols.append(idle_target(q1)), vals.append(pr)
    reward[:B] = (n - qi) * (1.0 - p)
    # busy states
    for b in range(B, n + 1):
        r_b = rs[b]
        for c in range(1, r_b + 1):
            t = r_b - c  # elapsed units of this L step
            steps = math.floor((t + 1) * (1.0 - alpha) + 1e-9) > math.floor(t * (1.0 - alpha) + 1e-9)
            q = np.arange(n - b + 1)
            src = idx[q, b, c]
            if steps:
                s, q1, pr = s_step(src, q, n - b - q)
                reward[src] += (n - b - q) * (1.0 - p)
            else:
                s, q1, pr = src, q, np.ones(len(q))
            if c > 1:
                rows.append(s), cols.append(idx[q1, b, c - 1]), vals.append(pr)
            else:
                reward[src] += b
                sp_pmf = span[b]
                kk = np.arange(b + 1)
                s2 = np.repeat(s, b + 1)
                q2 = (q1[:, None] + kk[None, :]).ravel()
                pr2 = (pr[:, None] * sp_pmf[None, :]).ravel()
                keep = pr2 > 0
                rows.append(s2[keep]), cols.append(idle_target(q2[keep])), vals.append(pr2[keep])
    P = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(k, k))
    P.sum_duplicates()
    return FullChain(n=n, b=B, P=P, states=states_a, reward=reward)
