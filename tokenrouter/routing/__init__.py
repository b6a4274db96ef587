"""Routing algorithms: the API (route, send, receive) and the built-in algorithms by name."""

from __future__ import annotations

from typing import Any

from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm
from tokenrouter.routing.bernoulli import Bernoulli
from tokenrouter.routing.citer import Citer
from tokenrouter.routing.co_llm import CoLLM
from tokenrouter.routing.ensemble import Ensemble
from tokenrouter.routing.peer_req import PeerReq
from tokenrouter.routing.r2r import R2R
from tokenrouter.routing.r_stitch import RStitch
from tokenrouter.routing.single import SingleModel

ALGORITHMS: dict[str, type[RoutingAlgorithm]] = {
    cls.name: cls for cls in (SingleModel, Bernoulli, Citer, R2R, CoLLM, RStitch, Ensemble)}


def make_algorithm(name: str, models: list[str], params: dict[str, Any] | None = None) -> RoutingAlgorithm:
    cls = ALGORITHMS.get(name)
    if cls is None:
        raise ValueError(f"unknown routing algorithm {name!r}; available: {', '.join(sorted(ALGORITHMS))}")
    try:
        return cls(models, **(params or {}))
    except TypeError as e:
        raise ValueError(f"{name}: bad parameters {params}: {e}") from None


__all__ = ["ALGORITHMS", "PeerReq", "Route", "RoutingAlgorithm", "STAY", "make_algorithm"]
