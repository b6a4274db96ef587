"""A per-step trace of the latency-model executor, and what the runtime adds to the profile, read off it.

With TOKENROUTER_STEP_TRACE=DIR in the environment, every `LatencyModelRunner` step, and every step of
a real model whose engine knows its index in the group (`Engine(trace_index=...)`, as a subserver's
does), appends one JSON line to DIR/<pid>.jsonl: [model index, start, end, request ids, extend
lengths] and, when the step ran look-ahead rows, their request ids; times from `time.perf_counter`
(CLOCK_MONOTONIC on Linux, so comparable across the group's processes). An environment variable,
because the subservers are spawned by the entry and inherit it, so tracing needs no change to the
group config or the wire protocol.

The runtime around the executor adds stage records to the same files (JSON objects, not lists):
{"model": index, "start": t, "stages": {stage: seconds}}, one per step, written by the subserver
after the step's runner line (-1 for the entry, per poll); a return answered from a look-ahead row
without a step is a line {"model": index, "answered": [request ids], "at": t}. The benchmarks read
the files with tokenrouter/bench/trace_reader.py.
"""

from __future__ import annotations

import json
import os
from typing import IO

from tokenrouter.engine.req import Req

ENV = "TOKENROUTER_STEP_TRACE"


class StepTraceWriter:
    """Appends one line per step; opened lazily in the process that steps (after the spawn)."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._file: IO[str] | None = None

    @classmethod
    def from_env(cls) -> StepTraceWriter:
        return cls(os.environ.get(ENV) or None)

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def write(self, model: int, start: float, end: float, rids: list[str], extend_lens: list[int],
              ahead: list[str] | None = None) -> None:
        if self.directory is not None:
            self._line(json.dumps([model, start, end, rids, extend_lens] + ([ahead] if ahead else [])))

    def write_batch(self, model: int, start: float, end: float, reqs: list[Req], extend_lens: list[int]) -> None:
        """A step's line from its batch: look-ahead rows (engine.py Engine.hand_off) apart, since they
        are not their requests' decisions."""
        if self.directory is None:
            return
        own = [(r.rid, n) for r, n in zip(reqs, extend_lens) if not r.look_ahead]
        self.write(model, start, end, [rid for rid, _ in own], [n for _, n in own],
                   [r.rid for r in reqs if r.look_ahead])

    def write_answered(self, model: int, at: float, rids: list[str]) -> None:
        """Returns `model` answered at `at` from look-ahead rows, without a step: each is a visit."""
        if self.directory is not None:
            self._line(json.dumps({"model": model, "answered": rids, "at": at}))

    def write_stages(self, model: int, start: float, stages: dict[str, float]) -> None:
        """Seconds per stage of the runtime around one step (or one entry poll), when tracing."""
        if self.directory is not None:
            self._line(json.dumps({"model": model, "start": start, "stages": stages}))

    def _line(self, line: str) -> None:
        if self._file is None:
            assert self.directory is not None
            # line-buffered: a subserver killed at shutdown still leaves whole lines behind
            self._file = open(os.path.join(self.directory, f"{os.getpid()}.jsonl"), "a", buffering=1)
        self._file.write(line + "\n")
