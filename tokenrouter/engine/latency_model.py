"""The latency-model executor: the real runtime with a forward that computes nothing.

A `LatencyModelRunner` stands in for the model runner: it takes the same batch, waits for the step
latency a profile gives (a function of batch size and tokens in the step), and returns tokens drawn
per (request seed, position). Everything else is real: scheduler, KV pages, prefix cache, transport,
routing. It measures scheduling at paper scale on a CPU, and lets CI exercise the runtime cheaply.

Co-located models slow each other. Each model's slot on the group's step board (step_board.py) says
whether it is running a step; while a peer runs, a model progresses at rate 1 - alpha (alpha from the
profile's `interference`: 0 = separate devices, 1 = serialised on one device).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenrouter.engine.draws import uniform
from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.engine.req import Req
from tokenrouter.engine.step_board import StepBoard
from tokenrouter.engine.step_trace import StepTraceWriter
from tokenrouter.models.config import ModelConfig

_TOKEN_STREAM = 0x70CE_4A11
_TICK = 0.0005  # seconds between progress updates while a peer may be running


@dataclass(frozen=True)
class StepLatency:
    """Seconds for one step: interpolated over `table` [(batch, seconds), ...] when given, else
    base + per_seq * batch; plus per_token for every token beyond one per request (prefill)."""

    base: float = 0.0
    per_seq: float = 0.0
    per_token: float = 0.0
    table: tuple[tuple[int, float], ...] = ()

    def __call__(self, batch: int, tokens: int) -> float:
        extra = self.per_token * max(0, tokens - batch)
        if not self.table:
            return self.base + self.per_seq * batch + extra
        xs = [b for b, _ in self.table]
        ys = [s for _, s in self.table]
        if batch <= xs[0]:
            return ys[0] + extra
        if batch >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            return ys[-1] + slope * (batch - xs[-1]) + extra
        i = bisect.bisect_right(xs, batch)
        w = (batch - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1]) + extra

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepLatency:
        table = tuple(sorted((int(b), float(s)) for b, s in d.get("table", [])))
        return cls(float(d.get("base", 0.0)), float(d.get("per_seq", 0.0)), float(d.get("per_token", 0.0)), table)

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base, "per_seq": self.per_seq, "per_token": self.per_token,
                "table": [list(x) for x in self.table]}


@dataclass
class LatencyProfile:
    """Step latencies per model name, interference between models, and notes on where they came from."""

    models: dict[str, StepLatency]
    interference: dict[str, dict[str, float]] = field(default_factory=dict)  # model -> {peer: alpha}
    notes: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencyProfile:
        models = {name: StepLatency.from_dict(v) for name, v in (d.get("models") or {}).items()}
        if not models:
            raise ValueError("a latency profile needs at least one model")
        inter = {m: {p: float(a) for p, a in peers.items()} for m, peers in (d.get("interference") or {}).items()}
        for m, peers in inter.items():
            for p, a in peers.items():
                if not 0.0 <= a <= 1.0:
                    raise ValueError(f"interference of {p} on {m} must be in [0, 1], got {a}")
        return cls(models, inter, str(d.get("notes", "")))

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            return cls.from_dict(yaml.safe_load(text))
        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        return {"models": {m: s.to_dict() for m, s in self.models.items()}, "interference": self.interference,
                "notes": self.notes}


class InterferenceClock:
    """Makes a step last `seconds` of progress, slowed while interfering peers run their own steps
    (their slots on the group's step board, step_board.py)."""

    def __init__(self, me: int, alphas: dict[int, float], board: StepBoard | None) -> None:
        self.me = me  # the model's index in its group
        self.alphas = {i: a for i, a in alphas.items() if a > 0}
        self.board = board

    def work(self, seconds: float, during: Callable[[], None] | None = None) -> None:
        """`during` runs first, inside the step (as the host's work runs while a device computes);
        its time counts as progress, and the step lasts longer only if it outlasts `seconds`."""
        board = self.board
        with board.running() if board is not None else contextlib.nullcontext():
            last = time.perf_counter()
            if during is not None:
                during()
            flags = board.flags if board is not None else None
            if flags is None or not self.alphas:
                _sleep(seconds - (time.perf_counter() - last))
                return
            done = 0.0
            while done < seconds:
                time.sleep(min(_TICK, max(seconds - done, 0.0)))
                now = time.perf_counter()
                rate = 1.0
                for peer, alpha in self.alphas.items():
                    if flags[peer] > 0:
                        rate -= alpha
                done += (now - last) * max(rate, 0.0)
                last = now


def _sleep(seconds: float) -> None:
    # time.sleep overshoots by tens of microseconds; finish the last stretch by spinning.
    end = time.perf_counter() + seconds
    if seconds > 0.002:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < end:
        pass


class LatencyModelRunner:
    """Same contract as ModelRunner.run; tokens are a pure function of (seed, position), never EOS."""

    def __init__(self, latency: StepLatency, vocab_size: int, eos_ids: set[int], clock: InterferenceClock) -> None:
        self.latency = latency
        self.clock = clock
        self.allowed = torch.tensor([t for t in range(vocab_size) if t not in eos_ids], dtype=torch.int64)
        self.trace = StepTraceWriter.from_env()

    @classmethod
    def for_model(cls, profile: LatencyProfile, name: str, model_path: str,
                  clock: InterferenceClock | None = None) -> LatencyModelRunner:
        """The runner of model `name` (its step latency in `profile`; vocabulary and EOS ids from the
        folder's config). Without a clock it never slows for a peer."""
        cfg = ModelConfig.from_folder(model_path)
        return cls(profile.models[name], cfg.vocab_size, set(cfg.eos_token_ids),
                   clock or InterferenceClock(0, {}, None))

    def run(self, reqs: list[Req], extend_lens: list[int], overlap: Callable[[], None] | None = None) -> StepOutput:
        """The draws and `overlap` (see Engine.forward_step) run inside the step's latency, as a
        device's sampling and the host's work during a device step do."""
        outs: list[StepOutput] = []

        def in_flight() -> None:
            outs.append(self._draw(reqs, extend_lens))
            if overlap is not None:
                overlap()

        start = time.perf_counter()
        self.clock.work(self.latency(len(reqs), sum(extend_lens)), in_flight)
        self.trace.write_batch(self.clock.me, start, time.perf_counter(), reqs, extend_lens)
        return outs[0]

    def _draw(self, reqs: list[Req], extend_lens: list[int]) -> StepOutput:
        sampled = [r for r, n in zip(reqs, extend_lens) if r.kv_len + n == len(r.tokens)]
        if not sampled:
            return StepOutput([], [], None, None, None, None, None, None)
        u = uniform([r.seed for r in sampled], [len(r.tokens) for r in sampled], _TOKEN_STREAM)
        idx = (u * len(self.allowed)).long().clamp_(max=len(self.allowed) - 1)
        return StepOutput(sampled, self.allowed[idx].tolist(), None, None, None, None, None, None)
