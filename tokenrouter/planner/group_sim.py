"""The throughput model for three or more models: one launch threshold per model, simulated.

The chains of chain.py and continuous.py hold two models, the small one eager. With K models that
each wait for their own threshold B_m there is no moment at which all but one are idle, so the
embedded chain does not apply, and the full chain's state (a queue, a batch and a countdown per
model) grows as (N^2 r / 2)^K. This simulates that system event by event instead, in the runtime's
timing (as tokenrouter.planner.sim does for two models):

- N requests, closed. A request is at one model: waiting for that model's next step, queued (a model
  that waits for its threshold), or in its running batch.
- Writers: after every token, the model that writes the next position is drawn from `weights`,
  independently per position (the ensemble router, tokenrouter/routing/ensemble.py); the same model
  keeps the request, another one gets it (the token is kept: no rewrite). A request's tokens at a
  model are thus runs of geometric length with mean 1 / (1 - w_m).
- Model m launches when idle and at least B_m(n) of its requests are ready (every ready one in the
  batch; B_m capped at N). A step of b requests takes t_m(b) plus its per-step overhead, plus
  `token_cost[m]` for every token beyond one that its requests bring (the tokens other models wrote
  since the request's last step on m: the catch-up). Requests handed to m arrive `handoff` seconds
  after the step that sent them.
- Interference: alpha[m][j] is how much model j's running step slows model m (m progresses at rate
  1 - sum_j alpha[m][j] over the running j, floored at 0).

Thresholds are deadlock free when sum_m (B_m - 1) <= N - 1 (docs/DESIGN.md section 5.8);
`best_group_thresholds` searches those vectors.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenrouter.planner.latency import LatencyLike, as_latency

__all__ = ["GroupSimResult", "simulate_group", "best_group_thresholds"]


@dataclass
class GroupSimResult:
    thresholds: tuple[int, ...]
    throughput: float  # tokens per second
    stderr: float
    tokens_per_model: list[int]
    seconds: float


def simulate_group(n: int, thresholds: Sequence[int], latencies: Sequence[LatencyLike], weights: Sequence[float],
                   alpha: Sequence[Sequence[float]] | float = 0.0, *, token_cost: Sequence[float] | None = None,
                   overhead: Sequence[float] | None = None, handoff: float = 0.0, tokens: int = 100_000,
                   warmup: float = 0.05, batches: int = 20, seed: int = 0) -> GroupSimResult:
    """Simulate N = n requests over K models for about `tokens` output tokens (model 0 takes every
    request first); see the module docstring."""
    k = len(latencies)
    if k < 2 or len(thresholds) != k or len(weights) != k:
        raise ValueError(f"one threshold, latency and weight per model (at least 2): got {len(thresholds)}, {k}, "
                         f"{len(weights)}")
    bs = [int(b) for b in thresholds]
    if any(b < 1 or b > n for b in bs):
        raise ValueError(f"thresholds must be in 1..N={n}, got {bs}")
    if sum(b - 1 for b in bs) > n - 1:
        raise ValueError(f"thresholds {bs} can deadlock at N={n}: the sum of (B - 1) must be at most {n - 1}")
    w = np.asarray(weights, dtype=float)
    if (w <= 0).any():
        raise ValueError(f"weights must be positive, got {list(weights)}")
    w = w / w.sum()
    a = np.full((k, k), float(alpha)) if np.isscalar(alpha) else np.asarray(alpha, dtype=float)
    np.fill_diagonal(a, 0.0)
    if a.shape != (k, k) or (a < 0).any() or (a > 1).any():
        raise ValueError("alpha: a number or a K x K matrix of values in [0, 1]")
    lat = [as_latency(x) for x in latencies]
    cost = np.zeros(k) if token_cost is None else np.asarray(token_cost, dtype=float)
    over = np.zeros(k) if overhead is None else np.asarray(overhead, dtype=float)
    rng = np.random.default_rng(seed)
    cum = np.cumsum(w)

    at = np.zeros(n, dtype=np.int64)  # the model each request is at
    written = np.zeros(n, dtype=np.int64)  # tokens the request has
    seen = np.zeros((n, k), dtype=np.int64)  # tokens it had when it last stepped on each model
    ready: list[list[int]] = [list(range(n)) if m == 0 else [] for m in range(k)]
    running: list[list[int]] = [[] for _ in range(k)]
    rem = np.zeros(k)  # seconds of full-speed work left in each running step
    transit: list[tuple[float, int, int]] = []  # (arrival time, request, model)
    t = 0.0
    total = 0
    per_model = [0] * k
    warm = int(warmup * tokens)
    t0 = None
    marks: list[tuple[float, int]] = []
    per_batch = max(1, (tokens - warm) // batches)
    eps = 1e-12

    def launch(m: int) -> None:
        reqs = ready[m]
        if not reqs or len(reqs) < min(bs[m], n):
            return
        ready[m] = []
        running[m] = reqs
        extra = sum(max(0, int(written[i] - seen[i, m]) - 1) for i in reqs)
        rem[m] = lat[m](len(reqs)) + over[m] + cost[m] * extra

    for m in range(k):
        launch(m)
    while total < tokens:
        busy = np.array([1.0 if running[j] else 0.0 for j in range(k)])
        rate = np.maximum(1.0 - a @ busy, 0.0)
        dts = [rem[m] / rate[m] if running[m] and rate[m] > 0 else math.inf for m in range(k)]
        dt_h = transit[0][0] - t if transit else math.inf
        dt = min(min(dts), dt_h)
        if dt == math.inf:
            raise RuntimeError("simulation stalled: no step can progress (thresholds that deadlock, or interference "
                               "that stops every running model)")
        t += dt
        for m in range(k):
            if running[m]:
                rem[m] -= dt * rate[m]
        done = [m for m in range(k) if running[m] and rem[m] <= eps * max(1.0, t)]
        for m in done:
            reqs, running[m] = running[m], []
            total += len(reqs)
            per_model[m] += len(reqs)
            nxt = np.searchsorted(cum, rng.random(len(reqs)), side="right").clip(max=k - 1)
            for i, j in zip(reqs, nxt):
                written[i] += 1
                seen[i, m] = written[i]
                if j == m:
                    ready[m].append(i)
                else:
                    at[i] = j
                    transit.append((t + handoff, i, int(j)))
            if t0 is None and total >= warm:
                t0, tok0 = t, total
            elif t0 is not None and (total - tok0) // per_batch > len(marks):
                marks.append((t, total))
        transit.sort()
        while transit and transit[0][0] <= t + eps * max(1.0, t):
            _, i, j = transit.pop(0)
            ready[j].append(i)
        for m in range(k):
            if not running[m]:
                launch(m)
    if t0 is None or t <= t0:
        raise ValueError("tokens too few for the warm-up")
    pts = [(t0, tok0)] + marks
    rates = [(b2 - b1) / (s2 - s1) for (s1, b1), (s2, b2) in zip(pts, pts[1:]) if s2 > s1]
    se = float(np.std(rates, ddof=1) / math.sqrt(len(rates))) if len(rates) > 1 else math.nan
    return GroupSimResult(tuple(bs), (total - tok0) / (t - t0), se, per_model, t - t0)


def best_group_thresholds(n: int, latencies: Sequence[LatencyLike], weights: Sequence[float],
                          alpha: Sequence[Sequence[float]] | float = 0.0, *, b_max: int | None = None,
                          min_gain: float = 0.01, **kw) -> tuple[tuple[int, ...], list[GroupSimResult]]:
    """Every deadlock-free threshold vector with each B_m <= b_max (default N), simulated; returns the
    chosen vector (the one of fewest waiting, sum of B - 1, within `min_gain` of the best throughput,
    as best_thresholds prefers eager launching) and every result."""
    k = len(latencies)
    top = min(n, b_max or n)
    results = [simulate_group(n, bs, latencies, weights, alpha, **kw)
               for bs in itertools.product(range(1, top + 1), repeat=k) if sum(b - 1 for b in bs) <= n - 1]
    best = max(r.throughput for r in results)
    ok = [r for r in results if r.throughput >= best / (1.0 + min_gain)]
    choice = min(ok, key=lambda r: (sum(r.thresholds), -r.throughput))
    return choice.thresholds, results
