"""Admission: a request is checked once, where it enters, into an AdmittedPlan; the plan then waits in
the AdmissionQueue until every model it may visit has room for its whole KV footprint.

The group's limits are constants once its subservers are up, so planning needs no lock: the HTTP
handlers plan on the event loop and hand the plan to the entry thread, which only queues it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from tokenrouter.engine.grammar import check_structured_output
from tokenrouter.engine.request_validation import InvalidRequest, validate_prompt
from tokenrouter.routing.request_options import RequestOptions, split_routing
from tokenrouter.runtime.messages import AddReq, Ready, encode
from tokenrouter.sampling_params import SamplingParams


@dataclass(frozen=True)
class AdmittedPlan:
    """A request that passed admission: everything the entry needs to run it."""

    prompt_ids: list[int]  # a copy of the caller's
    # The caller's, stop strings included, with max_tokens resolved (an int, the cap applied): every
    # model and the entry read the output budget from here.
    params: SamplingParams
    seed: int  # the caller's, or drawn here
    reserve: dict[str, int]  # KV tokens to reserve on each model the request may visit (none for one model)
    # Its routing parameters, resolved once here: the group's defaults with the request's overrides
    # (RoutingAlgorithm.resolve_request); every model reads these.
    routing: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The runtime's fields of the request's `routing` object: a per-token trace, one model alone.
    options: RequestOptions = RequestOptions()
    # The routing parameters the request set itself (the rest of `routing` are the group's): load
    # adaptation never moves a value the request chose.
    own_params: frozenset[str] = frozenset()

    def model_params(self) -> SamplingParams:
        """What the subservers see: stop strings are matched at the entry, where the whole text is."""
        return dataclasses.replace(self.params, stop=[])


@dataclass(frozen=True)
class PoolSize:
    page_size: int
    capacity_tokens: int


@dataclass(frozen=True)
class AdmissionRules:
    """The group's limits on one request, read from the subservers' Ready reports."""

    context_len: int  # the shortest context of the models a request may visit
    vocab_size: int  # the smallest vocabulary of those models
    pools: Mapping[str, PoolSize]  # the KV pool of each model a request may visit
    # The algorithm's resolve_request: a request's routing overrides, checked (RoutingParamError names
    # a bad field) and merged with the group's defaults. None: the algorithm takes no parameters.
    resolve_routing: Callable[[Mapping[str, Any] | None], dict[str, Any]] | None = None

    @classmethod
    def from_ready(cls, info: Mapping[str, Ready], visit: Sequence[str],
                   resolve_routing: Callable[[Mapping[str, Any] | None], dict[str, Any]] | None = None,
                   ) -> AdmissionRules:
        return cls(min(info[n].max_model_len for n in visit), min(info[n].vocab_size for n in visit),
                   {n: PoolSize(info[n].page_size, info[n].capacity_tokens) for n in visit}, resolve_routing)

    def plan(self, prompt_ids: Sequence[int], params: SamplingParams,
             routing: Mapping[str, Any] | None = None) -> AdmittedPlan:
        """The offline rule (vLLM's LLM): no max_tokens fills the context, one past it is cut to fit."""
        return self._plan(prompt_ids, params, routing, strict=False)

    def plan_openai(self, prompt_ids: Sequence[int], params: SamplingParams,
                    routing: Mapping[str, Any] | None = None) -> AdmittedPlan:
        """OpenAI's rule: no max_tokens fills the context, and one past the context is an error."""
        return self._plan(prompt_ids, params, routing, strict=True)

    def _plan(self, prompt_ids: Sequence[int], params: SamplingParams, routing: Mapping[str, Any] | None,
              strict: bool) -> AdmittedPlan:
        """Raise ValueError (InvalidRequest where a request field is to blame, RoutingParamError for
        a routing parameter) naming the problem."""
        options, overrides = split_routing(routing, list(self.pools))
        resolved = self.resolve_routing(overrides) if self.resolve_routing is not None else {}
        n, ctx, requested = len(prompt_ids), self.context_len, params.max_tokens
        if strict and requested is not None and n and n + requested > ctx:
            raise InvalidRequest(
                f"This model's maximum context length is {ctx} tokens. However, you requested {n + requested} "
                f"tokens ({n} in the prompt, {requested} in the completion). Please reduce the length of the "
                "prompt or completion.", "max_tokens")
        validate_prompt(prompt_ids, self.vocab_size, ctx)
        # The one place the output budget is decided: the models see this cap, never the context.
        cap = ctx - n if requested is None else min(requested, ctx - n)
        try:  # the fields checked against max_tokens (min_tokens) are checked again against the cap
            params = dataclasses.replace(params, max_tokens=cap)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise InvalidRequest(str(e), str(e).split(" ", 1)[0]) from None
        try:
            params.check_vocab(self.vocab_size)
        except ValueError as e:
            raise InvalidRequest(str(e), "logit_bias") from None
        if params.structured_output is not None:
            check_structured_output(params.structured_output)  # once here; each model compiles it for itself
        reserve = {}
        for name, pool in self.pools.items():
            reserve[name] = math.ceil((n + cap) / pool.page_size) * pool.page_size
            if reserve[name] > pool.capacity_tokens:
                raise InvalidRequest(f"request needs {reserve[name]} tokens of KV on model {name!r}, "
                                     f"whose pool holds {pool.capacity_tokens}")
        # A request that never leaves one model needs no reservation: that model's scheduler admits
        # what fits and preempts (recompute) under pressure, as a single-model server does. Only
        # hand-offs need room guaranteed ahead, because a PENDING request cannot be preempted.
        if options.model is not None:  # it never leaves that model; reserved there all the same, so
            reserve = {options.model: reserve[options.model]}  # the routed requests' reservations stay true
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        plan = AdmittedPlan(list(prompt_ids), params, seed, reserve if len(self.pools) > 1 else {}, resolved,
                            options, frozenset(overrides))
        try:  # it must fit the wire format (msgpack integers are 64-bit), or sending it would fail later
            encode(AddReq("", plan.prompt_ids, plan.model_params(), seed, resolved))
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            raise ValueError(f"the request cannot be sent to the models: {e}") from None
        return plan


class Planned(Protocol):
    plan: AdmittedPlan


T = TypeVar("T", bound=Planned)


class AdmissionQueue(Generic[T]):
    """Requests wait here, first come first served, until every model they may visit has room to
    reserve their whole KV footprint, so a hand-off never finds a peer full. Entry thread only."""

    def __init__(self, capacity: Mapping[str, int]) -> None:
        self.capacity = dict(capacity)
        self.reserved = {n: 0 for n in capacity}  # KV tokens held by admitted requests, per model
        self.waiting: deque[T] = deque()

    def push(self, req: T) -> None:
        self.waiting.append(req)

    def pop_admissible(self) -> T | None:
        """The first waiting request, its footprint now reserved, if every pool has room for it."""
        if not self.waiting:
            return None
        reserve = self.waiting[0].plan.reserve
        if any(self.reserved[n] + t > self.capacity[n] for n, t in reserve.items()):
            return None
        for n, t in reserve.items():
            self.reserved[n] += t
        return self.waiting.popleft()

    def release(self, req: T) -> None:
        """An admitted request ended: its footprint is free again."""
        for n, t in req.plan.reserve.items():
            self.reserved[n] -= t

    def withdraw(self, req: T) -> None:
        """A waiting request ended before it was admitted."""
        if req in self.waiting:
            self.waiting.remove(req)
