"""Step latency of one model as a function of its batch size, for the throughput model.

A latency model maps a batch size b >= 1 (a real number is accepted) to the seconds one decoding
step of that batch takes. Three forms:

- `Constant(t)`: t(b) = t;
- `Linear(a, c)`: t(b) = a + c * b;
- `Table(points)`: measured (batch, seconds) points, linearly interpolated between points; below the
  first point the first value is used (a decode step does not get faster than at the smallest batch
  measured); above the last point the last segment is extended (the slope of the last two points),
  or the last value with a single point.

`as_latency(x)` turns the forms the API accepts into a model: a number (constant), a pair (a, c)
(linear), a sequence of (batch, seconds) pairs (table), a callable, a model, or a string spec as the
command line takes it (see `parse_latency`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np


class LatencyModel:
    """Seconds of one decoding step as a function of batch size."""

    def __call__(self, b: float) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def to_json(self) -> object:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class Constant(LatencyModel):
    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"step latency must be > 0 seconds, got {self.seconds}")

    def __call__(self, b: float) -> float:
        return float(self.seconds)

    def describe(self) -> str:
        return f"{self.seconds:g} s"

    def to_json(self) -> object:
        return {"constant": self.seconds}


@dataclass(frozen=True)
class Linear(LatencyModel):
    a: float
    c: float

    def __post_init__(self) -> None:
        if not (self.a + self.c > 0 and self.a + self.c * 1e6 > 0):
            raise ValueError(f"linear latency a + c*b must be > 0 for every b >= 1 (a={self.a}, c={self.c})")

    def __call__(self, b: float) -> float:
        return float(self.a + self.c * b)

    def describe(self) -> str:
        return f"{self.a:g} + {self.c:g}*b s"

    def to_json(self) -> object:
        return {"a": self.a, "c": self.c}


@dataclass(frozen=True)
class Table(LatencyModel):
    points: tuple[tuple[float, float], ...]

    def __init__(self, points: Sequence[Sequence[float]]) -> None:
        pts = sorted((float(b), float(s)) for b, s in points)
        if not pts:
            raise ValueError("a latency table needs at least one (batch, seconds) point")
        bs = [b for b, _ in pts]
        if len(set(bs)) != len(bs):
            raise ValueError(f"latency table has a batch size twice: {bs}")
        if any(s <= 0 for _, s in pts) or any(b <= 0 for b in bs):
            raise ValueError(f"latency table needs batch > 0 and seconds > 0: {pts}")
        object.__setattr__(self, "points", tuple(pts))

    def __call__(self, b: float) -> float:
        bs = np.array([p[0] for p in self.points])
        ss = np.array([p[1] for p in self.points])
        if b <= bs[0] or len(bs) == 1:
            return float(ss[0]) if b <= bs[0] else float(ss[-1])
        if b >= bs[-1]:
            slope = (ss[-1] - ss[-2]) / (bs[-1] - bs[-2])
            return float(max(ss[-1] + slope * (b - bs[-1]), 1e-12))
        return float(np.interp(b, bs, ss))

    def describe(self) -> str:
        return "table " + ",".join(f"{b:g}:{s:g}" for b, s in self.points)

    def to_json(self) -> object:
        return {"points": [list(p) for p in self.points]}


@dataclass(frozen=True)
class Function(LatencyModel):
    fn: Callable[[float], float]

    def __call__(self, b: float) -> float:
        v = float(self.fn(b))
        if not v > 0:
            raise ValueError(f"step latency must be > 0 seconds, got {v} at batch {b}")
        return v

    def describe(self) -> str:
        return f"function {getattr(self.fn, '__name__', repr(self.fn))}"

    def to_json(self) -> object:
        return {"function": self.describe()}


LatencyLike = Union[LatencyModel, float, int, str, Sequence, Callable[[float], float]]


def as_latency(x: LatencyLike) -> LatencyModel:
    """A latency model from a number, (a, c), [(batch, seconds), ...], a callable, a model or a spec."""
    if isinstance(x, LatencyModel):
        return x
    if isinstance(x, bool):
        raise TypeError("a latency cannot be a bool")
    if isinstance(x, (int, float, np.floating, np.integer)):
        return Constant(float(x))
    if isinstance(x, str):
        return parse_latency(x)
    if isinstance(x, dict):
        return _from_json(x)
    if callable(x):
        return Function(x)
    if isinstance(x, Sequence):
        items = list(x)
        if len(items) == 2 and all(isinstance(v, (int, float, np.floating, np.integer)) for v in items):
            return Linear(float(items[0]), float(items[1]))
        return Table(items)
    raise TypeError(f"cannot make a latency model from {x!r}")


def _from_json(obj: object) -> LatencyModel:
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return Constant(float(obj))
    if isinstance(obj, list):
        return Table(obj)
    if isinstance(obj, dict):
        if "constant" in obj:
            return Constant(float(obj["constant"]))
        if "points" in obj:
            return Table(obj["points"])
        if "a" in obj:
            return Linear(float(obj["a"]), float(obj.get("c", 0.0)))
    raise ValueError(f"latency JSON must be a number, [[batch, seconds], ...], {{'points': ...}}, "
                     f"{{'a': .., 'c': ..}} or {{'constant': ..}}; got {obj!r}")


def parse_latency(spec: str) -> LatencyModel:
    """Parse a command-line latency spec.

    - "0.02": constant 0.02 s per step;
    - "0.012,0.0003": linear, t(b) = 0.012 + 0.0003 * b;
    - "1:0.010,8:0.012,32:0.020": measured (batch:seconds) points, interpolated;
    - "@path.json": a JSON file holding one of the above (a number, {"a": .., "c": ..},
      [[batch, seconds], ...] or {"points": [[batch, seconds], ...]}).
    """
    s = spec.strip()
    if not s:
        raise ValueError("empty latency spec")
    if s.startswith("@"):
        return _from_json(json.loads(Path(s[1:]).read_text()))
    parts = [t.strip() for t in s.split(",") if t.strip()]
    try:
        if any(":" in t for t in parts):
            return Table([tuple(float(v) for v in t.split(":")) for t in parts])
        vals = [float(t) for t in parts]
    except ValueError:
        raise ValueError(f"bad latency spec {spec!r}: expected SECONDS, A,C, B1:S1,B2:S2,... or @file.json") from None
    if len(vals) == 1:
        return Constant(vals[0])
    if len(vals) == 2:
        return Linear(vals[0], vals[1])
    raise ValueError(f"bad latency spec {spec!r}: expected SECONDS, A,C, B1:S1,B2:S2,... or @file.json")
