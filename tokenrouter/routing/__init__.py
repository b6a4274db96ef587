"""Routing algorithms: the API (route, send, receive), the built-in algorithms, and how a spec (a
registered name, `pkg.module:Class` or `path/to/file.py:Class`) finds its class (registry.py)."""

from __future__ import annotations

from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm, RoutingParamError, unit_interval
from tokenrouter.routing.peer_req import PeerReq
from tokenrouter.routing.registry import (
    BUILTIN_ALGORITHMS,
    ENTRY_POINT_GROUP,
    absolute_spec,
    algorithm_class,
    make_algorithm,
    registered_names,
)

__all__ = ["BUILTIN_ALGORITHMS", "ENTRY_POINT_GROUP", "PeerReq", "Route", "RoutingAlgorithm", "RoutingParamError",
           "STAY", "absolute_spec", "algorithm_class", "make_algorithm", "registered_names", "unit_interval"]
