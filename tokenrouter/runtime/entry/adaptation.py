"""Load adaptation at the entry: requests start at the share knob's live value, their tokens' times
feed the TPOT window, and each closed window moves the knob (planner/knob_controller.py).

A request adapts unless it asked not to (`routing: {"adapt": false}`), set the knob itself, or runs
on one model alone; only adapting requests are measured, since only they can be sped up by the
knob. The value is fixed when a request starts (when the entry sends it to the subservers), so its
response's `routing.params` and its per-token trace's threshold say exactly which value served it.

Entry thread only, except `state`: a frozen snapshot replaced whole after each window, which the
server's metrics and model card read from other threads.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from tokenrouter.planner.knob_controller import RECENT_PART, KnobController
from tokenrouter.routing.algorithm import RoutingAlgorithm
from tokenrouter.runtime.adapt_config import AdaptConfig, knob_range
from tokenrouter.runtime.entry.admission import AdmittedPlan
from tokenrouter.runtime.entry.tpot_window import TpotWindow

logger = logging.getLogger(__name__)

LOGGED_MOVE = 0.1  # of the range: a move of more than this since the last logged value is logged


@dataclass(frozen=True)
class AdaptState:
    """The adaptation as of its last window, for gauges and the routing page."""

    algorithm: str
    param: str  # the share knob's name
    value: float  # what adapting requests start with now
    served: float
    floor: float
    target_s: float
    window_s: float
    p99_s: float | None = None  # the last window's p99 TPOT of adapting requests; None: none streamed
    shares: dict[str, float] = field(default_factory=dict)  # each model's share of those tokens, last window

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Adaptation:
    def __init__(self, cfg: AdaptConfig, algorithm: RoutingAlgorithm, now: float) -> None:
        """AdaptConfigError when the algorithm has no share knob or the floor is on the wrong side of
        its served point: the entry builds this before any subserver starts."""
        self.range = knob_range(cfg, algorithm)
        self.param = algorithm.knob_param()
        self.controller = KnobController(cfg.target_s)
        self.window_s = cfg.window
        self.closes_at = now + cfg.window
        self.window = TpotWindow(self.recent_from())
        self.opened = now  # when the window now open began to collect (the last close)
        self.adapting: set[str] = set()  # wire ids of the live requests that adapt
        self.logged = 1.0  # the position last logged (the served point at start)
        self.state = AdaptState(algorithm.name, self.param, self.range.served, self.range.served, self.range.floor,
                                cfg.target_s, cfg.window)

    def recent_from(self) -> float:
        """Where the open window's last part (measured apart: planner/knob_controller.py) begins."""
        return self.closes_at - RECENT_PART * self.window_s

    def adapts(self, plan: AdmittedPlan) -> bool:
        return plan.options.adapt and plan.options.model is None and self.param not in plan.own_params

    def start(self, wire: str, plan: AdmittedPlan) -> AdmittedPlan:
        """The plan a request starts with: at the knob's live value when it adapts, else as it is."""
        if not self.adapts(plan):
            return plan
        self.adapting.add(wire)
        return dataclasses.replace(plan, routing={**plan.routing, self.param: self.state.value})

    def token(self, wire: str, model: str, now: float) -> None:
        if wire in self.adapting:
            self.window.token(wire, model, now)

    def finish(self, wire: str) -> None:
        if wire in self.adapting:
            self.adapting.discard(wire)
            self.window.finish(wire)

    def poll(self, now: float) -> None:
        """Close every window that ended by `now` (one after another: a stall that skipped some closes
        them empty, which counts as idle) and move the knob after each."""
        while now >= self.closes_at:
            self.closes_at += self.window_s
            figures = self.window.close(now, self.recent_from())
            # after a stall the first window closed holds every gap since the last close
            load = figures.streaming_s / max(self.window_s, now - self.opened)
            recent_load = figures.recent_streaming_s / figures.recent_s if figures.recent_s > 0 else None
            self.opened = now
            position = self.controller.update(figures.p99_s, load, figures.recent_p99_s, recent_load)
            old = self.state
            self.state = dataclasses.replace(old, value=self.range.value(position), p99_s=figures.p99_s,
                                             shares=figures.shares)
            if abs(position - self.logged) > LOGGED_MOVE:
                before, self.logged = self.range.value(self.logged), position
                p99 = ("no adapting request" if figures.p99_s is None
                       else f"p99 TPOT {figures.p99_s * 1e3:.1f} ms at a load of {load:.2f}")
                logger.info("load adaptation: %s %s %.4g -> %.4g (%s, target %.1f ms; served %.4g, floor %.4g)",
                            old.algorithm, self.param, before, self.state.value, p99, old.target_s * 1e3,
                            self.range.served, self.range.floor)
