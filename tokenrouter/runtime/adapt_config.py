"""Load adaptation's settings: the `adapt:` section of a group's YAML, or `tokenrouter serve
--target-tpot-ms MS [--adapt-floor VALUE] [--adapt-window S]`. Checked once here; errors name the
field (`AdaptConfigError.field`, which the command line turns into its flag).

The knob is the group algorithm's `share_knob` (RoutingAlgorithm), so a plug-in that declares one
adapts too; `knob_range` places the floor against the served point (the group's value of the knob).

The default floor halves the odds of the end of the knob that gives the large model nothing (p to
p / (2 - p), where p is the knob, or its complement for a knob whose raising lowers the share). Where
the knob is about the probability of a large token (Bernoulli's p; a calibrated router's threshold
on a probability) that is about half the served point's large share: half the large model's load
spent, and the cheapest half of the router's deferrals kept. On the default pair it moves R2R's
threshold from the served 0.1314 to 0.2322 (the Xeon's pair), 0.2125 to 0.3505 (the EPYC's).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenrouter.planner.knob_controller import KnobRange
from tokenrouter.routing.algorithm import RoutingAlgorithm


class AdaptConfigError(ValueError):
    """A bad adaptation setting; `field` names it (an AdaptConfig field)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"adapt.{field} {problem}")
        self.field, self.problem = field, problem


def _positive(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise AdaptConfigError(field, f"must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class AdaptConfig:
    target_tpot_ms: float  # the p99 time per output token to hold, over each window
    floor: float | None = None  # the knob value the adaptation stops at; None: the default (module docstring)
    window: float = 10.0  # seconds per measurement window: the controller moves once per window

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_tpot_ms", _positive("target_tpot_ms", self.target_tpot_ms))
        object.__setattr__(self, "window", _positive("window", self.window))
        f = self.floor
        if f is not None:
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:  # NaN too
                raise AdaptConfigError("floor", f"must be a value of the share knob, a number in [0, 1], got {f!r}")
            object.__setattr__(self, "floor", float(f))

    @property
    def target_s(self) -> float:
        return self.target_tpot_ms / 1e3

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AdaptConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"adapt: unknown field(s) {', '.join(map(str, unknown))}; "
                             f"known: {', '.join(sorted(known))}")
        if "target_tpot_ms" not in d:
            raise AdaptConfigError("target_tpot_ms", "is required: the latency target the adaptation holds")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_floor(served: float, raises_share: bool) -> float:
    """The knob at half the odds of its no-large-tokens end from `served` (module docstring)."""
    if raises_share:
        return served / (2.0 - served)
    return 1.0 - (1.0 - served) / (1.0 + served)


def knob_range(cfg: AdaptConfig, algorithm: RoutingAlgorithm) -> KnobRange:
    """The range the knob of `algorithm` moves on, from its served value to the floor; AdaptConfigError
    when the algorithm has no knob or the floor is on the wrong side of the served point."""
    knob = algorithm.share_knob
    if knob is None:
        raise AdaptConfigError("target_tpot_ms", f"needs an algorithm with a share knob (share_knob) to move; "
                                                 f"{algorithm.name} has none")
    param, raises = knob
    served = algorithm.request_defaults().get(param)
    if isinstance(served, bool) or not isinstance(served, (int, float)) or not 0.0 <= served <= 1.0:
        raise AdaptConfigError("target_tpot_ms", f"needs the share knob {param} of {algorithm.name} to be a number "
                                                 f"in [0, 1]; the group serves {served!r}")
    served = float(served)
    floor = default_floor(served, raises) if cfg.floor is None else cfg.floor
    if (floor > served) if raises else (floor < served):
        fewer = "lower" if raises else "higher"
        raise AdaptConfigError("floor", f"{floor:g} is above the served point: {algorithm.name} serves "
                                        f"{param}={served:g}, and only a {fewer} {param} gives the large model fewer "
                                        f"tokens, so the floor must lie between {served:g} and {0 if raises else 1}")
    return KnobRange(served, floor)
