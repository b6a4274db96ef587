"""Online delayed batching: the large model's launch threshold B(n) from the throughput model,
re-planned as the routing probability measured on live traffic drifts.

The small model launches eagerly and only the large model waits for B requests, so thresholds are
deadlock free for any B <= n (see launch_policy). Re-planning runs in a worker thread so the entry
loop never blocks on the solver.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tokenrouter.planner.chain import best_thresholds
from tokenrouter.planner.overheads import Overheads

logger = logging.getLogger(__name__)

Latency = Callable[[int], float]


class PlannerController:
    def __init__(self, small: str, large: str, lat_s: Latency, lat_l: Latency, alpha: float, n_max: int,
                 p0: float = 0.1, min_tokens: int = 500, min_interval: float = 5.0, tolerance: float = 0.2,
                 overheads: Overheads | None = None, window: int | None = 2000) -> None:
        self.small, self.large = small, large
        self.overheads = overheads  # given: plan with the continuous-time chain (spans then fall back to none)
        self.lat_s, self.lat_l = lat_s, lat_l
        self.alpha, self.n_max = alpha, n_max
        self.min_tokens, self.min_interval, self.tolerance = min_tokens, min_interval, tolerance
        if window is not None and window < 1:
            raise ValueError(f"planner window must be >= 1 token, got {window}")
        # The counts halve every `window` tokens, so the estimate forgets a share that changed (an
        # exponential memory of about `window` tokens; docs/BENCHMARKS.md, "The share changes half-way").
        # None: p and q_L over every token since the start.
        self.window = window
        self._since_decay = 0
        self.seen = 0  # tokens observed since the start (never decayed)
        self.small_tokens = self.large_tokens = self.visits = 0
        self.p_planned, self.q_planned = p0, 0.0
        self.table = self._solve(p0, 0.0)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")
        self._pending: Future[dict[int, int]] | None = None
        self._pending_pq = (p0, 0.0)
        self._last = time.monotonic()

    def _solve(self, p: float, q_l: float) -> dict[int, int]:
        p = min(max(p, 1e-4), 1.0)
        q_l = min(q_l, 0.99) if self.overheads is None else 0.0  # the continuous chain has one-token visits
        table = best_thresholds(self.n_max, p, self.lat_s, self.lat_l, self.alpha, q_l=q_l, min_gain=0.01,
                                overheads=self.overheads)
        logger.info("planner: p=%.3f q_l=%.3f alpha=%.2f -> B(n) %s", p, q_l, self.alpha, table)
        return table

    def observe(self, prev: str | None, model: str) -> None:
        """One committed token written by `model`, after one written by `prev` (None: the first)."""
        self.seen += 1
        if model == self.large:
            self.large_tokens += 1
            if prev != self.large:
                self.visits += 1
        else:
            self.small_tokens += 1
        if self.window is not None:
            self._since_decay += 1
            if self._since_decay >= self.window:
                self._since_decay = 0
                self.small_tokens /= 2
                self.large_tokens /= 2
                self.visits /= 2

    @property
    def estimate(self) -> tuple[float, float]:
        """(p, q_l): the chance an S decision goes to L, and the chance L keeps writing."""
        decisions = self.small_tokens + self.visits
        p = self.visits / decisions if decisions else self.p_planned
        q = (self.large_tokens - self.visits) / self.large_tokens if self.large_tokens else 0.0
        return p, q

    def poll(self) -> dict[int, int] | None:
        """A new table when a re-plan finished with a different one; starts re-plans as p drifts."""
        if self._pending is not None and self._pending.done():
            fut, self._pending = self._pending, None
            self.p_planned, self.q_planned = self._pending_pq
            table = fut.result()
            if table != self.table:
                self.table = table
                return table
            return None
        if self._pending is None and self.seen >= self.min_tokens:
            now = time.monotonic()
            p, q = self.estimate
            drift = abs(p - self.p_planned) / max(self.p_planned, 1e-3) + abs(q - self.q_planned)
            if now - self._last >= self.min_interval and drift > self.tolerance:
                self._last = now
                self._pending_pq = (p, q)
                self._pending = self._pool.submit(self._solve, p, q)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
