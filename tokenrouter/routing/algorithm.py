"""The routing API: an algorithm is `route`, `send` and `receive`, written for one request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.engine.req import Req
from tokenrouter.routing.peer_req import PeerReq

if TYPE_CHECKING:
    from tokenrouter.engine.engine import Engine


class Route(NamedTuple):
    """Where a request's next token comes from, decided after a step.

    dest None: stay on this model. Otherwise hand the request to model `dest`; `keep` says whether
    the token just sampled here is committed first (the ensemble keeps it; R2R, CITER and Co-LLM drop
    the small model's uncertain token so the peer writes that position).
    """

    dest: str | None
    keep: bool = True


STAY = Route(None, True)


class RoutingAlgorithm(ABC):
    """A token-level routing algorithm over a named group of models.

    The runtime calls, on the model that just ran a step:
      route(model, step) once per step that sampled a request, for the whole batch (vectorise: one
        matrix product for an MLP router, not a Python loop) -> one Route per sampled request;
      send(req, dest, known) for each request routed away -> the PeerReq for dest, where `known` is
        how many of req's tokens dest already holds (0 on a first visit);
    and on the destination:
      receive(peer_req, model) -> the PeerReq to apply (default: accept as is).
    `outputs(model)` declares the step outputs route needs on that model; the runner computes
    only those. Every model named in a Route must be in `models`.
    """

    name: ClassVar[str]

    def __init__(self, models: list[str], **params: Any) -> None:
        if len(set(models)) != len(models) or not models:
            raise ValueError(f"{self.name}: model names must be distinct and non-empty, got {models}")
        if params:
            raise ValueError(f"{self.name}: unknown parameter(s) {', '.join(sorted(params))}")
        self.models = list(models)

    @property
    def entry_model(self) -> str:
        """The model that receives new requests (writes the first token)."""
        return self.models[0]

    def may_visit(self) -> list[str]:
        """The models a request may visit: admission reserves KV on each of them."""
        return list(self.models)

    def outputs(self, model: str) -> StepOutputSpec:
        return StepOutputSpec()

    def bind(self, model: str, engine: Engine) -> None:  # noqa: B027 - an optional hook
        """Called once in the subserver of `model` after its engine is built: load routers, check
        they were trained for this model, take what route needs from the model (e.g. embeddings)."""

    @abstractmethod
    def route(self, model: str, step: StepOutput) -> list[Route]: ...

    def send(self, req: Req, dest: str, known: int) -> PeerReq:
        return PeerReq(rid=req.rid, suffix=req.tokens[known:], loc=known)

    def receive(self, peer: PeerReq, model: str) -> PeerReq:
        return peer
