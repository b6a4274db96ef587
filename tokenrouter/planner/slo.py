"""The threshold B under a tail-latency objective: the most throughput whose p99 inter-token latency
stays within a bound.

Delayed batching trades latency for throughput: a larger B fills the large model's batch, but a
request handed off waits for B - 1 others, and co-located, every L step freezes the small model's
batch. The chains give throughput only; the inter-token latency distribution comes from the
simulator (tokenrouter.planner.sim), which runs the same system event by event (with the runtime's
costs when given) and records each request's gaps between tokens. For every candidate B this
simulates once and keeps the B of highest throughput among those whose p99 ITL is within the bound;
when none is, the B of lowest p99 (reported as infeasible).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenrouter.planner.latency import LatencyLike, as_latency
from tokenrouter.planner.overheads import Overheads
from tokenrouter.planner.sim import simulate

__all__ = ["SloPoint", "SloChoice", "slo_threshold"]


@dataclass
class SloPoint:
    b: int
    throughput: float  # tokens per second (simulated)
    stderr: float
    itl_p50: float  # seconds
    itl_p99: float


@dataclass
class SloChoice:
    b: int
    feasible: bool  # whether the chosen B meets the bound
    itl_p99_max: float
    points: list[SloPoint]  # every candidate B, in order

    def point(self) -> SloPoint:
        return next(pt for pt in self.points if pt.b == self.b)


def slo_threshold(n: int, lat_s: LatencyLike, lat_l: LatencyLike, alpha: float = 0.0, *, itl_p99_max: float,
                  p: float | None = None, gaps=None, overheads: Overheads | None = None,
                  b_values: Sequence[int] | None = None, s_steps: int = 30_000, seed: int = 0) -> SloChoice:
    """The B in `b_values` (default 1..n) of highest simulated throughput with p99 ITL <= itl_p99_max
    seconds. Gaps between hand-offs: geometric with p, or a measured histogram `gaps` (see simulate)."""
    if not itl_p99_max > 0:
        raise ValueError(f"the p99 inter-token latency bound must be > 0 seconds, got {itl_p99_max}")
    bs = list(range(1, n + 1)) if b_values is None else sorted({int(b) for b in b_values})
    if not bs or bs[0] < 1 or bs[-1] > n:
        raise ValueError(f"thresholds must be in 1..N={n}, got {list(b_values or [])}")
    lat_s, lat_l = as_latency(lat_s), as_latency(lat_l)
    points = []
    for b in bs:
        r = simulate(n, b, lat_s, lat_l, alpha, p=p, gaps=gaps, overheads=overheads, s_steps=s_steps, seed=seed)
        points.append(SloPoint(b, r.throughput, r.stderr, r.itl_percentile(50), r.itl_percentile(99)))
    ok = [pt for pt in points if pt.itl_p99 <= itl_p99_max]
    if ok:
        return SloChoice(max(ok, key=lambda pt: pt.throughput).b, True, itl_p99_max, points)
    return SloChoice(min(points, key=lambda pt: pt.itl_p99).b, False, itl_p99_max, points)
