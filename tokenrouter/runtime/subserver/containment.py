"""Per-request containment of a routing algorithm's batched call, as the engine contains a failed step
(tokenrouter/engine/engine.py): when `route` raises for a step's batch, it runs again one request at a
time, and only the requests it raises on fail.

Rows are independent inputs to `route` (a request's routing decision reads its own row of the step,
its own parameters and its own state), so a request routed alone gets the decision it would have got
in the batch; the draws of the built-in algorithms are keyed by (request seed, position), never by the
batch, so the re-run is token-exact.
"""

from __future__ import annotations

import logging

from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.routing.algorithm import Route, RoutingAlgorithm, Scores

logger = logging.getLogger(__name__)


def checked_route(algorithm: RoutingAlgorithm, model: str, step: StepOutput,
                  traced: bool = False) -> tuple[list[Route], Scores | None]:
    """`algorithm.route` (`route_traced` when a request of the step asked for a trace) with its one
    promise checked: a Route per sampled request."""
    routes, scores = algorithm.route_traced(model, step) if traced else (algorithm.route(model, step), None)
    routes = list(routes)
    if len(routes) != len(step.reqs):
        raise ValueError(f"{algorithm.name}.route returned {len(routes)} routes for {len(step.reqs)} requests")
    return routes, scores


def route_each(algorithm: RoutingAlgorithm, model: str, step: StepOutput) -> list[Route | None]:
    """Route each request of `step` alone (after `route` raised on the whole batch): its Route, or None
    for a request that raises alone. When none raises alone the batch as a whole failed: all None."""
    routes: list[Route | None] = []
    for i, req in enumerate(step.reqs):
        try:
            (route,), _ = checked_route(algorithm, model, step.rows([i]))
        except Exception:  # noqa: BLE001 - this request is one the algorithm fails on
            logger.exception("%s: %s.route failed on request %s alone", model, algorithm.name, req.rid)
            route = None
        routes.append(route)
    if len(step.reqs) > 1 and all(r is not None for r in routes):
        return [None] * len(routes)
    return routes
