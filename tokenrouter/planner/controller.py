"""Online delayed batching: the large model's launch threshold B(n) from the throughput model,
re-planned as the routing probability measured on live traffic drifts.

The small model launches eagerly and only the large model waits for B requests, so thresholds are
deadlock free for any B <= n (see launch_policy). Re-planning runs in a worker thread so the entry
loop never blocks on the solver.

With `overheads` (the per-token costs of each model; tokenrouter/runtime/entry/launch_planner.py gives the
step latencies' prefill slopes) the controller re-plans with the continuous-time chain and the
catch-up it measures, once it has seen enough visits: the tokens the small model wrote between two
of the large model's visits, counted only over runs that did reach the large model. Runs cut by a
request's end never do, so on real routers the catch-up is below what a geometric gap of the same p
implies (docs/BENCHMARKS.md, "Real send patterns": the chain with it within 6 % at nine points, the
geometric one 10-13 % low for Co-LLM).

With the large model's look-ahead on (`look_ahead`; docs/DESIGN.md section 3) its algorithm hands
every request back after one token, so a large-model token right after another is a request that
came straight back, not a span: a visit with nothing to catch up on, answered without a step when
its look-ahead row had run. The subserver marks the tokens it answered that way (`answered`), and the
chains plan with that share (tokenrouter/planner/chain.py `throughput_curve`'s `answered`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tokenrouter.planner.chain import best_thresholds
from tokenrouter.planner.overheads import Overheads

logger = logging.getLogger(__name__)

# The continuous-time chain's cost grows about as N^4 (on this machine its table for N = 1..8 took
# 0.07 s, for 1..32 24 s, for 1..64 over ten minutes: a re-plan that long held a core of the two the
# models were served on, and the pair at concurrency 8 lost 37 % against eager launching: the float32
# default pair of 2026-12-04). So it plans N up to this; larger N keep the step-aligned chain (0.15 s for 1..32).
CONTINUOUS_MAX_N = 12

Latency = Callable[[int], float]


class PlannerController:
    def __init__(self, small: str, large: str, lat_s: Latency, lat_l: Latency, alpha: float, n_max: int,
                 p0: float = 0.1, min_tokens: int = 500, min_interval: float = 5.0, tolerance: float = 0.2,
                 overheads: Overheads | None = None, window: int | None = 2000, min_visits: int = 20,
                 look_ahead: bool = False) -> None:
        """`overheads`: once `min_visits` visits of the large model were seen, re-plan with the
        continuous-time chain on them and the measured catch-up (spans then planned as one-token
        visits) for N up to CONTINUOUS_MAX_N. Until then, above it, and without `overheads`, the
        step-aligned chain (fast: the first table is solved here, at start-up)."""
        self.small, self.large = small, large
        self.look_ahead = look_ahead
        self.overheads = overheads
        self.min_visits = min_visits
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
        self.small_tokens = self.large_tokens = self.visits = 0.0
        self.caught_up = 0.0  # tokens the large model caught up on, over the visits counted in `visits`
        self.returns = 0.0  # with look-ahead: large-model tokens right after one (counted in `visits` too)
        self.answered_returns = 0.0  # of those, the ones a look-ahead row answered
        self.p_planned, self.q_planned, self.catchup_planned, self.answered_planned = p0, 0.0, None, 0.0
        self.table = self._solve(p0, 0.0, None, 0.0)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")
        self._pending: Future[dict[int, int]] | None = None
        self._pending_at: tuple[float, float, float | None, float] = (p0, 0.0, None, 0.0)
        self._last = time.monotonic()

    def _solve(self, p: float, q_l: float, catchup: float | None, answered: float) -> dict[int, int]:
        p = min(max(p, 1e-4), 1.0)
        q_l = min(q_l, 0.99)
        answered = min(max(answered, 0.0), 0.99)
        table = best_thresholds(self.n_max, p, self.lat_s, self.lat_l, self.alpha, q_l=q_l, min_gain=0.01,
                                answered=answered)
        if self.overheads is not None and catchup is not None:
            ov = dataclasses.replace(self.overheads, catchup=catchup)
            try:  # the continuous chain has one-token visits
                table |= best_thresholds(min(self.n_max, CONTINUOUS_MAX_N), p, self.lat_s, self.lat_l, self.alpha,
                                         min_gain=0.01, overheads=ov, answered=answered)
                logger.info("planner: p=%.3f catch-up %.2f answered %.2f alpha=%.2f -> B(n) %s", p, catchup,
                            answered, self.alpha, table)
                return table
            except ValueError as e:  # past the continuous chain's limits: the step-aligned chain serves
                logger.warning("planner: %s; planning with the step-aligned chain", e)
        logger.info("planner: p=%.3f q_l=%.3f answered %.2f alpha=%.2f -> B(n) %s", p, q_l, answered, self.alpha,
                    table)
        return table

    def observe(self, prev: str | None, model: str, run: int = 0) -> None:
        """One committed token written by `model`, after one written by `prev` (None: the first);
        `run`: the tokens of the same request before this one since the large model last wrote one (or
        since its first), which a visit of the large model catches up on."""
        self.seen += 1
        if model == self.large:
            self.large_tokens += 1
            if prev != self.large:
                self.visits += 1
                self.caught_up += run
            elif self.look_ahead:  # came straight back: a visit that catches up on nothing
                self.visits += 1
                self.returns += 1
        else:
            self.small_tokens += 1
        if self.window is not None:
            self._since_decay += 1
            if self._since_decay >= self.window:
                self._since_decay = 0
                self.small_tokens /= 2
                self.large_tokens /= 2
                self.visits /= 2
                self.caught_up /= 2
                self.returns /= 2
                self.answered_returns /= 2

    def answered(self, tokens: int) -> None:
        """`tokens` large-model tokens were written from look-ahead rows, without a step (counted by
        `observe` as returns too)."""
        self.answered_returns += tokens

    @property
    def answered_visits(self) -> float:
        """The visits a look-ahead row answered (the subserver's count, never above the returns seen)."""
        return min(self.answered_returns, self.returns)

    @property
    def answered_share(self) -> float:
        """The share of the large model's visits a look-ahead row answered (0 without look-ahead)."""
        return self.answered_visits / self.visits if self.visits else 0.0

    @property
    def catchup(self) -> float | None:
        """Mean tokens a queued visit of the large model caught up on (the answered ones queue for
        no step); None before `min_visits` visits."""
        queued = self.visits - self.answered_visits
        return self.caught_up / queued if self.visits >= self.min_visits and queued > 0 else None

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
            self.p_planned, self.q_planned, self.catchup_planned, self.answered_planned = self._pending_at
            table = fut.result()
            if table != self.table:
                self.table = table
                return table
            return None
        if self._pending is None and self.seen >= self.min_tokens:
            now = time.monotonic()
            p, q = self.estimate
            a = self.answered_share
            drift = (abs(p - self.p_planned) / max(self.p_planned, 1e-3) + abs(q - self.q_planned)
                     + abs(a - self.answered_planned))
            c = self.catchup if self.overheads is not None else None
            before = self.catchup_planned
            if c is None:  # too few visits in the window: keep what was planned with
                c = before
            elif before is None:
                drift += 1.0  # the first measured catch-up: re-plan with it
            else:
                drift += abs(c - before) / max(before, 1.0)
            if now - self._last >= self.min_interval and drift > self.tolerance:
                self._last = now
                self._pending_at = (p, q, c, a)
                self._pending = self._pool.submit(self._solve, p, q, c, a)
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
