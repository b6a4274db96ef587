"""A per-step trace of the latency-model executor, and what the runtime adds to the profile, read off it.

With TOKENROUTER_STEP_TRACE=DIR in the environment, every `LatencyModelRunner` step appends one JSON
line to DIR/<pid>.jsonl: [model index, start, end, request ids, extend lengths], times from
`time.perf_counter` (CLOCK_MONOTONIC on Linux, so comparable across the group's processes). An
environment variable, because the subservers are spawned by the entry and inherit it, so tracing
needs no change to the group config or the wire protocol.

`runtime_costs` turns a trace of a two-model group into the figures the throughput model needs
beyond the profile (see tokenrouter.planner.overheads): the gap between consecutive steps of each model
when it had work (scheduling, routing, messaging: the per-step overhead), and the hand-off latency
from the end of an S step to the start of the L step that takes the request, when L was idle.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import IO

import numpy as np

ENV = "TOKENROUTER_STEP_TRACE"


class StepTraceWriter:
    """Appends one line per step; opened lazily in the process that steps (after the spawn)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._file: IO[str] | None = None

    @classmethod
    def from_env(cls) -> StepTraceWriter:
        return cls(os.environ.get(ENV) or None)

    def write(self, model: int, start: float, end: float, rids: list[str], extend_lens: list[int]) -> None:
        if self.directory is None:
            return
        if self._file is None:
            # line-buffered: a subserver killed at shutdown still leaves whole lines behind
            self._file = open(os.path.join(self.directory, f"{os.getpid()}.jsonl"), "a", buffering=1)
        self._file.write(json.dumps([model, start, end, rids, extend_lens]) + "\n")


@dataclass
class Step:
    model: int
    start: float
    end: float
    rids: list[str]
    extend_lens: list[int]


def read_trace(directory: str, start: float = -np.inf, end: float = np.inf) -> list[Step]:
    """Every traced step that began in [start, end], sorted by start time."""
    steps = []
    for path in glob.glob(os.path.join(directory, "*.jsonl")):
        with open(path) as f:
            for line in f:
                m, t0, t1, rids, lens = json.loads(line)
                if start <= t0 <= end:
                    steps.append(Step(m, t0, t1, rids, lens))
    return sorted(steps, key=lambda s: s.start)


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
