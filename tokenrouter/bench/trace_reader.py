"""Reading the per-step trace (tokenrouter/engine/step_trace.py writes it), and what the runtime adds
to the profile, read off it.

`read_stages` pairs each stage record with the model step before it in its file
(benchmarks/runtime_stages.py turns them into a table). `runtime_costs` turns a trace of a two-model
group into the figures the throughput model needs beyond the profile (see tokenrouter.planner.overheads):
the gap between consecutive steps of each model when it had work (scheduling, routing, messaging: the
per-step overhead), and the hand-off latency from the end of an S step to the start of the L step that
takes the request, when L was idle. `visit_runs`, `send_runs` and `request_legs` give the run lengths
and the legs the planner's simulator models (tokenrouter/planner/sim.py).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tokenrouter.planner.sim import LEGS


@dataclass
class Step:
    model: int
    start: float
    end: float
    rids: list[str]
    extend_lens: list[int]
    # The requests at a peer whose look-ahead rows the step also ran, one token each (engine.py
    # Engine.hand_off): computed, but not those requests' decisions, so not in rids.
    ahead_rids: list[str] = field(default_factory=list)
    # A return answered from a look-ahead row (read_trace's with_answered): a visit of one decision
    # at `start` (= end) that ran no step; its one row ran in an earlier step, counted there.
    answered: bool = False

    @property
    def ahead(self) -> int:
        """Its look-ahead rows."""
        return len(self.ahead_rids)

    @property
    def rows(self) -> int:
        """The tokens the step ran through the model."""
        return sum(self.extend_lens) + self.ahead


@dataclass
class StageRecord:
    model: int  # -1: the entry
    start: float
    stages: dict[str, float]  # seconds
    step: Step | None  # the model step it surrounds (the subserver's records), else None


def read_trace(directory: str, start: float = -np.inf, end: float = np.inf,
               with_answered: bool = False) -> list[Step]:
    """Every traced step that began in [start, end], sorted by start time. `with_answered`: also each
    return answered from a look-ahead row, as a Step with `answered` set (one request, one token, no
    duration), for the readers of visits (visit_runs, request_legs); never for step costs."""
    steps = [s for s in _read(directory) if isinstance(s, Step) and start <= s.start <= end
             and (with_answered or not s.answered)]
    return sorted(steps, key=lambda s: s.start)


def read_stages(directory: str, start: float = -np.inf, end: float = np.inf) -> list[StageRecord]:
    """Every stage record that began in [start, end], sorted by start time."""
    recs = [r for r in _read(directory) if isinstance(r, StageRecord) and start <= r.start <= end]
    return sorted(recs, key=lambda r: r.start)


def _read(directory: str) -> list[Step | StageRecord]:
    out: list[Step | StageRecord] = []
    for path in glob.glob(os.path.join(directory, "*.jsonl")):
        last: Step | None = None
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if isinstance(rec, dict) and "answered" in rec:
                    out.extend(Step(rec["model"], rec["at"], rec["at"], [rid], [1], answered=True)
                               for rid in rec["answered"])
                elif isinstance(rec, dict):
                    step = last if rec["model"] >= 0 else None
                    out.append(StageRecord(rec["model"], rec["start"], rec["stages"], step))
                    last = None
                else:
                    last = Step(*rec)
                    out.append(last)
    return out


@dataclass
class RuntimeCosts:
    """Seconds the runtime adds to the profile's step latencies (means over a trace: throughput goes
    with the mean cycle)."""

    s_step_gap: float  # S: from the end of one step to the start of the next, S never idle in between
    l_step_gap: float  # L: the same, for L relaunching on a queue that was already waiting
    handoff: float  # end of the S step that hands a request off -> start of the L step running it (L idle)
    s_steps: int
    l_steps: int
    handoffs: int

    def to_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def runtime_costs(steps: list[Step], small: int = 0, large: int = 1, max_gap: float = 0.005) -> RuntimeCosts:
    """Overheads of a two-model group from its trace. Gaps above `max_gap` seconds are idle periods,
    not overhead, and are left out; so are hand-offs to an L that was still busy (queueing, which the
    throughput model accounts for itself)."""
    s = [x for x in steps if x.model == small]
    ls = [x for x in steps if x.model == large]
    s_gap = np.diff([x.start for x in s]) - np.array([x.end - x.start for x in s[:-1]]) if len(s) > 1 else np.array([])
    l_end = np.array([x.end for x in ls])
    l_gap = np.array([b.start - a.end for a, b in zip(ls, ls[1:])])
    last_s_end: dict[str, float] = {}
    waits = []
    for x in steps:  # in start order: each L step follows the S step that handed its requests off
        if x.model == small:
            for r in x.rids:
                last_s_end[r] = x.end
            continue
        prev_l_end = l_end[l_end <= x.start].max(initial=-np.inf)
        for r in x.rids:
            t = last_s_end.pop(r, None)
            if t is not None and prev_l_end <= t:  # L was idle when the hand-off arrived
                waits.append(x.start - t)
    return RuntimeCosts(
        s_step_gap=float(np.mean(s_gap[s_gap < max_gap])) if (s_gap < max_gap).any() else 0.0,
        l_step_gap=float(np.mean(l_gap[l_gap < max_gap])) if (l_gap < max_gap).any() else 0.0,
        handoff=float(np.mean(waits)) if waits else 0.0,
        s_steps=len(s), l_steps=len(ls), handoffs=len(waits))


@dataclass
class Runs:
    """Run lengths of one model read off a trace: a run is the consecutive steps of that model on one
    request. `sent` ended in a hand-off to another model; `cut` ended with the request (censored:
    the request finished, or the trace window closed, before the run would have ended)."""

    sent: list[int]
    cut: list[int]


def visit_runs(steps: list[Step]) -> dict[str, list[tuple[int, int, int]]]:
    """Each request's visits in order, as (model, steps in a row on it, tokens fed), from a trace sorted
    by start. A step on a request is one token decision of that model (prefill included: its step
    samples the request's first token), so a visit's steps are the run length between two sends. Fed:
    the tokens beyond one that the visit's first step computed for the request (what the other model
    wrote since this one last saw it; on a first visit, the prompt and those tokens less what the
    model's prefix cache held). After a look-ahead row of the model's own last token rode in one of
    its steps, that one token was computed there: the visit's first step computes only the catch-up
    (unless the return was answered, a visit of one token). A return that cuts the model's own last
    token away (no built-in algorithm's) recomputes it, which the trace does not show: one too many."""
    visits: dict[str, list[list[int]]] = {}
    rode: set[tuple[str, int]] = set()  # (request, model): a look-ahead row ran since the model's last step on it
    for s in steps:
        for rid, ext in zip(s.rids, s.extend_lens):
            v = visits.setdefault(rid, [])
            if v and v[-1][0] == s.model:
                v[-1][1] += 1
            else:
                ahead = (rid, s.model) in rode and not s.answered
                v.append([s.model, 1, ext - 1 + ahead])
            rode.discard((rid, s.model))
        rode.update((rid, s.model) for rid in s.ahead_rids)
    return {rid: [(m, k, fed) for m, k, fed in v] for rid, v in visits.items()}


def request_legs(steps: list[Step], start: float, end: float, small: int = 0) -> dict[str, float]:
    """The mean number of requests in each leg (tokenrouter.planner.sim.LEGS, which the simulator
    reports alike) over the window [start, end] of a two-model
    trace sorted by start time: each request's time in that leg inside the window, summed over
    requests, over the window's length. Little's law turns these into time per request; the rest of
    the live requests are outside every leg (admitted but not yet stepped, or done but not yet
    replaced). `steps` must hold each request's steps on both sides of the window's edges (read the
    whole trace, not only the window)."""
    if end <= start:
        raise ValueError(f"request_legs: empty window [{start}, {end}]")
    legs = dict.fromkeys(LEGS, 0.0)
    last: dict[str, Step] = {}

    def add(leg: str, a: float, b: float) -> None:
        legs[leg] += max(0.0, min(b, end) - max(a, start))

    for s in steps:
        on = "on_s" if s.model == small else "on_l"
        for rid in s.rids:
            prev = last.get(rid)
            if prev is not None:
                same = prev.model == s.model
                add(on if same else ("to_l" if prev.model == small else "back_to_s"), prev.end, s.start)
            add(on, s.start, s.end)
            last[rid] = s
    return {k: v / (end - start) for k, v in legs.items()}


def send_runs(steps: list[Step], model: int) -> Runs:
    """Run lengths (steps) of `model` between sends: every visit but a request's last ends in a send."""
    sent: list[int] = []
    cut: list[int] = []
    for v in visit_runs(steps).values():
        for i, (m, k, _) in enumerate(v):
            if m == model:
                (sent if i < len(v) - 1 else cut).append(k)
    return Runs(sent, cut)


def latency_ratio(steps: list[Step], model: int, latency: Callable[[int, int], float],
                  apart_from: int | None = None) -> float:
    """Measured over modelled seconds of `model`'s steps: sum of durations / sum of latency(batch,
    tokens). Above 1 when the machine stretched the executor's sleeps (a loaded host). Steps that
    overlap one of `apart_from`'s are left out (a co-located peer slows them on purpose). NaN when
    no step is left."""
    peer = np.array([(s.start, s.end) for s in steps if s.model == apart_from]) if apart_from is not None else None
    took = modelled = 0.0
    for s in steps:
        if s.model != model:
            continue
        if peer is not None and len(peer) and ((peer[:, 0] < s.end) & (peer[:, 1] > s.start)).any():
            continue
        took += s.end - s.start
        modelled += latency(len(s.rids) + s.ahead, s.rows)
    return took / modelled if modelled > 0 else float("nan")
