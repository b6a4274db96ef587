"""Closed-loop load on a routed group without HTTP: the Entry driven directly, for scheduling
benchmarks (the ablation, the planner check) where the HTTP layer would only add noise."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenrouter.runtime.entry.entry import Entry, EntryReq
from tokenrouter.runtime.entry.reassembly import Done, TokenOut
from tokenrouter.sampling_params import SamplingParams


@dataclass
class OfflineResult:
    output_tokens: int
    wall_seconds: float
    latencies: list[float]
    per_user: list[float]
    tokens_per_model: dict[str, int]
    # Steady state: from the moment every request has written `warmup_tokens` tokens on average to
    # the first finish after the last admission, i.e. while exactly `concurrency` requests are live.
    # A closed-loop run's whole-run figure also holds its drain at the end, where fewer are live.
    steady_window: tuple[float, float] = (0.0, 0.0)  # perf_counter times
    steady_tokens: int = 0
    # As the entry hands them out (no HTTP): time to first token per request, and every gap between
    # two consecutive tokens of one request (inter-token latency), in seconds.
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def steady_throughput(self) -> float:
        span = self.steady_window[1] - self.steady_window[0]
        return self.steady_tokens / span if span > 0 else 0.0

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def mean_per_user(self) -> float:
        return statistics.fmean(self.per_user) if self.per_user else 0.0


def run_closed_loop(entry: Entry, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                    seed: int = 0, timeout: float = 3600.0, warmup_tokens: int = 20,
                    routings: Sequence[Mapping[str, Any] | None] | None = None) -> OfflineResult:
    """Keep `concurrency` requests in flight until every prompt is done (request i uses seed + i, and
    the routing object routings[i] when given)."""
    if routings is not None and len(routings) != len(prompts):
        raise ValueError(f"routings: one per prompt needed, got {len(routings)} for {len(prompts)} prompts")
    todo = list(enumerate(prompts))
    live: dict[str, tuple[EntryReq, float]] = {}
    last_token: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    done: list[tuple[EntryReq, float]] = []
    start = time.perf_counter()
    warm: tuple[float, int] | None = None
    steady_end: tuple[float, int] | None = None
    while todo or live:
        while todo and len(live) < concurrency:
            i, ids = todo.pop(0)
            p = SamplingParams(**{**params.__dict__, "seed": seed + i})
            req = entry.add(ids, p, routing=None if routings is None else routings[i])
            live[req.rid] = (req, time.perf_counter())
        for ev in entry.poll(0.01):
            if isinstance(ev, TokenOut) and ev.rid in live:
                now = time.perf_counter()
                prev = last_token.get(ev.rid)
                if prev is None:
                    ttft.append(now - live[ev.rid][1])
                else:
                    itl.append(now - prev)
                last_token[ev.rid] = now
            if isinstance(ev, Done) and ev.rid in live:
                last_token.pop(ev.rid, None)
                req, t0 = live.pop(ev.rid)
                if req.error is not None:
                    raise RuntimeError(f"request failed: {req.error}")
                done.append((req, time.perf_counter() - t0))
                if not todo and steady_end is None:
                    steady_end = (time.perf_counter(), _written(live, done))
        if warm is None and _written(live, done) >= warmup_tokens * concurrency:
            warm = (time.perf_counter(), _written(live, done))
        if time.perf_counter() - start > timeout:
            raise TimeoutError("closed-loop run did not finish")
    wall = time.perf_counter() - start
    per_model: dict[str, int] = {}
    for req, _ in done:
        for m, n in req.out.tokens_per_model().items():
            per_model[m] = per_model.get(m, 0) + n
    return OfflineResult(
        output_tokens=sum(len(r.out.tokens) for r, _ in done), wall_seconds=wall,
        latencies=[lat for _, lat in done], per_user=[len(r.out.tokens) / lat for r, lat in done if lat > 0],
        tokens_per_model=per_model,
        steady_window=(warm[0], steady_end[0]) if warm and steady_end and steady_end[0] > warm[0] else (0.0, 0.0),
        steady_tokens=steady_end[1] - warm[1] if warm and steady_end and steady_end[0] > warm[0] else 0,
        ttft=ttft, itl=itl)


def _written(live: dict[str, tuple[EntryReq, float]], done: list[tuple[EntryReq, float]]) -> int:
    return sum(len(r.out.tokens) for r, _ in live.values()) + sum(len(r.out.tokens) for r, _ in done)
