"""The online launch planner of a two-model group (launch policy "planner"): the large model's
launch thresholds B(n), planned from step latencies, the routing probability and the catch-up per
visit that the entry observes."""

from __future__ import annotations

from collections.abc import Mapping

from tokenrouter.engine.latency_model import StepLatency
from tokenrouter.planner.controller import PlannerController
from tokenrouter.planner.overheads import Overheads
from tokenrouter.routing.algorithm import RoutingAlgorithm
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Ready


def make_planner(group: GroupConfig, info: Mapping[str, Ready],
                 algorithm: RoutingAlgorithm) -> PlannerController | None:
    """The planner, when the group asks for one. Step latencies come from the group's profile, or
    else from the subservers' start-up measurements (their Ready reports). It plans for look-ahead
    when the algorithm has the large model run ahead (routing/algorithm.py looks_ahead) and the
    group's `launch.look_ahead` leaves it on."""
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
    look_ahead = launch.look_ahead and algorithm.looks_ahead(large)
    n_max = launch.n_max or min(64, group.spec(small).engine.max_running_requests)
    # Each model's cost per token beyond one, so the chain charges the catch-up the controller measures.
    overheads = Overheads(s_token=lat[small].per_token, l_token=lat[large].per_token)
    return PlannerController(small, large, lambda b: lat[small](b, b), lambda b: lat[large](b, b),
                             launch.alpha, n_max, p0=launch.p, overheads=overheads, look_ahead=look_ahead)
