"""The routing API: an algorithm is `route`, `send` and `receive`, written for one request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

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

    `draft`: the token is a proposal (speculative decoding). It is appended on this model but neither
    output nor checked for a stop; with dest None the request drafts on here, else `dest` verifies
    every draft the request holds in one step: it commits the longest run its own samples agree
    with, then its own next token, and hands the request back cut there (Req.drafts).
    """

    dest: str | None
    keep: bool = True
    draft: bool = False


STAY = Route(None, True)


class Scores(NamedTuple):
    """The numbers behind a step's routes, one per sampled request in row order: the router's score
    and the threshold it was compared with (for a per-token trace of the routing)."""

    score: list[float]
    threshold: list[float]


class RoutingParamError(ValueError):
    """A routing parameter is bad; `field` names it (an HTTP 400's `param` is routing.FIELD)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def unit_interval(field: str, value: Any) -> float:
    """`value` as a float in [0, 1], or RoutingParamError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:  # NaN too
        raise RoutingParamError(field, f"must be a number in [0, 1], got {value!r}")
    return float(value)


def unit_param(algorithm: str, field: str, value: Any) -> float:
    """A constructor's (the group's) value of `field` as a float in [0, 1], or ValueError naming both."""
    try:
        return unit_interval(field, value)
    except RoutingParamError:
        raise ValueError(f"{algorithm}: {field} must be in [0, 1], got {value}") from None


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

    A call that raises fails only the request(s) it raised for: when `route` raises for a batch, the
    runtime calls it again with each request alone (a step of one row) and fails the ones that raise
    alone, so a request's Route must depend only on its own row, parameters and state, and `route`
    must not change per-request state before it can raise.

    Each model's subserver holds its own instance (built from the same class and parameters), so
    state an instance keeps is that model's. The request lifecycle on one model:
      on_start(req) when the request first arrives on this model (a new request on the entry model,
        a first hand-off on a peer), before any step of it, with params_of[req.rid] already set;
      route/send/receive for its steps and hand-offs;
      on_finish(req) exactly once when it ends on this model (finished here, finished on a peer,
        aborted, or failed), after which params_of no longer holds it.
    Both hooks are no-ops by default; an algorithm with per-request state creates it in on_start and
    frees it in on_finish.

    Per-request parameters: `request_params` names the constructor parameters a request may set for
    itself (the `routing` object of an OpenAI request, or RoutedLLM's `routing=`). The instance keeps
    each one's group value in the attribute of the same name (the default); `check_request_params`
    validates a request's overrides (RoutingParamError naming the field); the runtime resolves them
    once at the entry and gives every model the result in `params_of[rid]` ({name: value} for every
    name of request_params). `request_values(step, name)` reads one of them for a whole step.

    `share_knob`: the one of `request_params` that `tokenrouter calibrate` searches (see below).

    Scores (a request's per-token trace): `route_traced(model, step)` returns route's routes together
    with the `Scores` behind them (each row's score and the threshold it was compared with), or None
    for an algorithm without a score (the default). The runtime calls it instead of route only on steps
    where some request asked for a trace (`routing: {"trace": true}`), so an algorithm pays nothing for
    it otherwise; it must decide exactly as route does. `score_name` says what the score is.
    The fields `trace` and `model` of a request's `routing` object are the runtime's
    (routing/request_options.py), never an algorithm's parameters.

    `needs_router`: the algorithm reads a trained router folder (its `router` parameter), so a group's
    `routers:` section may name one for it by the algorithm's name.
    """

    name: ClassVar[str]
    needs_router: ClassVar[bool] = False
    request_params: ClassVar[tuple[str, ...]] = ()
    # The per-request parameter (a number in [0, 1]) that sets how many tokens the other models write,
    # and whether raising it makes them write more (True) or fewer: `tokenrouter calibrate` searches it
    # for a target share. None: the algorithm has no such knob.
    share_knob: ClassVar[tuple[str, bool] | None] = None
    # What route_traced's score measures (e.g. "confidence"); None: the algorithm has no score.
    score_name: ClassVar[str | None] = None

    def __init__(self, models: list[str], **params: Any) -> None:
        if len(set(models)) != len(models) or not models:
            raise ValueError(f"{self.name}: model names must be distinct and non-empty, got {models}")
        if params:
            raise ValueError(f"{self.name}: unknown parameter(s) {', '.join(sorted(params))}")
        self.models = list(models)
        self.params_of: dict[str, dict[str, Any]] = {}  # rid -> this request's routing parameters

    @property
    def entry_model(self) -> str:
        """The model that receives new requests (writes the first token)."""
        return self.models[0]

    def alone_at(self, live: int) -> str | None:
        """The model that writes a request by itself (as a request's `routing: {"model": NAME}`) when
        it starts while the group holds `live` live requests, itself among them; None, the default,
        routes it. For an algorithm whose routing stops paying under load; the entry asks once per
        request, as it starts (its tokens' writers then name that model)."""
        return None

    def may_visit(self) -> list[str]:
        """The models a request may visit: admission reserves KV on each of them."""
        return list(self.models)

    def outputs(self, model: str) -> StepOutputSpec:
        return StepOutputSpec()

    def looks_ahead(self, model: str) -> bool:
        """Whether `model`, after writing a token and handing the request away, runs that token in
        its next step and keeps the next sample aside, to answer at once if the request comes straight
        back with nothing new (the group's `launch.look_ahead` may turn it off). Worth it where a
        request often returns at the very next position; the row is one the next visit computes
        anyway, so it costs a row only after a request's last visit."""
        return False

    def bind(self, model: str, engine: Engine) -> None:  # noqa: B027 - an optional hook
        """Called once in the subserver of `model` after its engine is built: load routers, check
        they were trained for this model, take what route needs from the model (e.g. embeddings)."""

    @abstractmethod
    def route(self, model: str, step: StepOutput) -> list[Route]: ...

    def route_traced(self, model: str, step: StepOutput) -> tuple[list[Route], Scores | None]:
        """route's routes, and the score and threshold behind each one (None: no score)."""
        return self.route(model, step), None

    def send(self, req: Req, dest: str, known: int) -> PeerReq:
        return PeerReq(rid=req.rid, suffix=req.tokens[known:], loc=known)

    def receive(self, peer: PeerReq, model: str) -> PeerReq:
        return peer

    # ---- the request lifecycle -----------------------------------------------------------------
    def on_start(self, req: Req) -> None:  # noqa: B027 - an optional hook
        """`req` arrived on this model; create its per-request state here."""

    def on_finish(self, req: Req) -> None:  # noqa: B027 - an optional hook
        """`req` ended on this model (whatever the reason); free its per-request state here."""

    def start(self, req: Req, params: Mapping[str, Any]) -> None:
        """The runtime's call on a request's arrival: record its routing parameters, then on_start."""
        self.params_of[req.rid] = dict(params) if params else self.request_defaults()
        self.on_start(req)

    def finish(self, req: Req) -> None:
        """The runtime's call when a started request ends on this model: on_finish, then forget it."""
        if req.rid in self.params_of:
            try:
                self.on_finish(req)
            finally:
                del self.params_of[req.rid]

    # ---- per-request parameters ----------------------------------------------------------------
    @classmethod
    def check_request_params(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """One request's overrides, validated and normalised; RoutingParamError names a bad field.
        Subclasses check values by overriding check_request_value."""
        if not isinstance(params, Mapping):
            raise RoutingParamError("", f"must be an object of {cls.name}'s per-request parameters")
        out = {}
        for field, value in params.items():
            if field not in cls.request_params:
                takes = ", ".join(cls.request_params) or "none"
                raise RoutingParamError(field, f"{cls.name} has no per-request parameter {field!r} (it takes: {takes})")
            out[field] = cls.check_request_value(field, value)
        return out

    @classmethod
    def check_request_value(cls, field: str, value: Any) -> Any:
        return value

    @classmethod
    def knob_param(cls) -> str:
        """The name of the `share_knob` parameter (a router's threshold); ValueError when there is none."""
        if cls.share_knob is None:
            raise ValueError(f"algorithm {cls.name} has no share_knob (no threshold parameter)")
        return cls.share_knob[0]

    def request_defaults(self) -> dict[str, Any]:
        """The group's value of every per-request parameter."""
        return {field: getattr(self, field) for field in self.request_params}

    def resolve_request(self, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
        """A request's routing parameters: the group's defaults with its validated overrides."""
        return {**self.request_defaults(), **self.check_request_params(overrides or {})}

    def request_values(self, step: StepOutput, field: str, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-request parameter `field` of each sampled request of `step`, as one tensor (compare it
        with scores of the same dtype: a float64 draw against a float32 p would round p)."""
        return torch.tensor([self.params_of[r.rid][field] for r in step.reqs], dtype=dtype, device=device)
