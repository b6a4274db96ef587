"""The runtime's own fields of a request's `routing` object; every other field is a parameter of the
group's algorithm (RoutingAlgorithm.request_params).

- `trace` (bool): per-token attribution. Each output token then says which model wrote it, the
  hand-offs that happened just before it, and the router's score and threshold at its position
  (RoutingAlgorithm.route_traced); without it the runtime carries none of this.
- `model` (a model name): that model alone writes the whole request; no routing decision is taken
  for it (the way to compare an answer with each model's own).
- `adapt` (bool, default true): whether the server's load adaptation (`--target-tpot-ms`,
  runtime/entry/adaptation.py) may serve the request at a moved value of the algorithm's share knob; false
  keeps it at the group's served point (or at its own value of the knob, which is never moved).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenrouter.routing.algorithm import RoutingParamError

RUNTIME_FIELDS = ("trace", "model", "adapt")


@dataclass(frozen=True)
class RequestOptions:
    trace: bool = False
    model: str | None = None  # the one model that writes the request; None: the algorithm routes it
    adapt: bool = True  # load adaptation may move its share knob


def split_routing(routing: Mapping[str, Any] | None, models: Sequence[str]
                  ) -> tuple[RequestOptions, dict[str, Any]]:
    """(the runtime's options, the algorithm's overrides) of a request's `routing` object; `models`:
    the models a request may be pinned to. RoutingParamError names a bad field."""
    if routing is None:
        return RequestOptions(), {}
    if not isinstance(routing, Mapping):
        raise RoutingParamError("", "must be an object")
    trace = routing.get("trace", False)
    if not isinstance(trace, bool):
        raise RoutingParamError("trace", f"must be true or false, got {trace!r}")
    model = routing.get("model")
    if model is not None and (not isinstance(model, str) or model not in models):
        raise RoutingParamError("model", f"must be one of the group's models {list(models)}, got {model!r}")
    adapt = routing.get("adapt", True)
    if not isinstance(adapt, bool):
        raise RoutingParamError("adapt", f"must be true or false, got {adapt!r}")
    rest = {k: v for k, v in routing.items() if k not in RUNTIME_FIELDS}
    return RequestOptions(trace, model, adapt), rest
