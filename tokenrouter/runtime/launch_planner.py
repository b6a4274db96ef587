"""The online launch planner of a two-model group (launch policy "planner"): the large model's
launch thresholds B(n), planned from step latencies and the routing probability the entry observes."""

from __future__ import annotations

from collections.abc import Mapping

from tokenrouter.engine.latency_model import StepLatency
from tokenrouter.planner.controller import PlannerController
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Ready


def make_planner(group: GroupConfig, info: Mapping[str, Ready]) -> PlannerController | None:
    """The planner, when the group asks for one. Step latencies come from the group's profile, or
    else from the subservers' start-up measurements (their Ready reports)."""
    launch = group.launch
    if launch.policy != "planner":
        return None
    small, large = group.names
    prof = group.planner_profile()
    lat = {}
    for name in (small, large):
        if prof is not None:
            lat[name] = prof.models[name]
        elif info[name].latency is not None:
            lat[name] = StepLatency.from_dict(info[name].latency)
        else:
            raise ValueError(f"no step latency for {name!r}: give the planner a profile")
    n_max = launch.n_max or min(64, group.spec(small).engine.max_running_requests)
    return PlannerController(small, large, lambda b: lat[small](b, b), lambda b: lat[large](b, b),
                             launch.alpha, n_max, p0=launch.p)
