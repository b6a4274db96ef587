"""The entry: the client side of a routed group. No HTTP: the offline API and the server both drive it.

It composes parts kept one file each: the SubserverPool (the processes and the sockets to them),
admission (a request is checked once into an AdmittedPlan, which waits in the AdmissionQueue for
room in every KV pool it may need), the Reassembly of each request's tokens (in position order,
with stop strings and text release), the launch planner and load adaptation (adaptation.py). New
requests and aborts go out to the subservers; committed tokens (each with its absolute position and
the model that wrote it) and finishes come back and leave as TokenOut and Done events.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenrouter.engine.step_trace import StepTraceWriter
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.planner.controller import PlannerController
from tokenrouter.routing import make_algorithm
from tokenrouter.runtime.entry.adaptation import Adaptation
from tokenrouter.runtime.entry.admission import AdmissionQueue, AdmissionRules, AdmittedPlan
from tokenrouter.runtime.entry.launch_planner import make_planner
from tokenrouter.runtime.entry.placement import plan_placement
from tokenrouter.runtime.entry.reassembly import Done, Reassembly, TokenOut
from tokenrouter.runtime.entry.remote_subserver import RemoteSubserver
from tokenrouter.runtime.entry.subserver_pool import SubserverDied, SubserverPool
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import (
    Abort,
    Active,
    AddReq,
    Finished,
    PromptLogprobs,
    Ready,
    ReqError,
    SetThresholds,
    Stats,
    StatsQuery,
    Tokens,
)
from tokenrouter.runtime.model_identity import vocab_hash
from tokenrouter.sampling_params import SamplingParams

__all__ = ["Entry", "EntryReq", "SubserverDied"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class EntryReq:
    """One request at the entry: its plan, its output as reassembled, and how it ended."""

    rid: str  # the caller's id
    wire: str  # the id on the wire, `rid#n` for its admission n: a reused rid never meets stale messages
    plan: AdmittedPlan
    out: Reassembly
    final: Finished | None = None  # the subservers' finish, once it came
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    admitted: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    finish_time: float | None = None
    since_large: int = 0  # tokens placed since the large model last wrote one (the launch planner's catch-up)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def done_event(self, text: str = "") -> Done:
        return self.out.done(self.finish_reason or "stop", self.stop_reason, self.error, text, self.plan.routing)


class Entry:
    """Owns the subservers and the request table; raises SubserverDied when one dies."""

    def __init__(self, group: GroupConfig, detokenize: bool = False) -> None:
        """`detokenize`: release text with token events (streaming servers). Text that could still
        become a stop string is held back until it cannot."""
        # Fixes co-located models' KV budgets before they start: the planned group, and what to log.
        group, placement_lines = plan_placement(group)
        self.group = group
        self.detokenize = detokenize
        self.algorithm = make_algorithm(group.algorithm, group.names, group.algorithm_params)
        # Before any subserver starts: a floor on the wrong side of the served point is refused here.
        self.adaptation = (Adaptation(group.adapt, self.algorithm, time.monotonic())
                           if group.adapt is not None else None)
        self.visit = self.algorithm.may_visit()
        self.pool = SubserverPool(group)
        self.reqs: dict[str, EntryReq] = {}  # the live requests, by caller's rid (by wire id: _by_wire)
        self._wire_seq = 0
        self._next_rid = 0
        self._closed = False
        self._backlog: list[TokenOut | Done] = []
        self._stats: dict[str, Stats] = {}
        self._active_sent = 0
        self._checked = 0.0  # when the idle entry last checked its records (check_integrity)
        self.planner: PlannerController | None = None
        self.trace = StepTraceWriter.from_env()  # the entry's stage records (model -1), when tracing
        # Each subserver message's handler, by the message's type (no message type subclasses another).
        self._handlers: dict[type, Callable[[Any, list[TokenOut | Done]], None]] = {
            Tokens: self._on_tokens,
            PromptLogprobs: self._on_prompt_logprobs,
            Finished: self._on_finished,
            ReqError: self._on_req_error,
            Stats: self._on_stats,
        }
        atexit.register(self.close)
        try:
            # Before the subservers: joiners are checked against the entry model's vocabulary.
            self.tokenizer = load_tokenizer(group.spec(self.algorithm.entry_model).engine.model_path)
            self.vocab_hash = vocab_hash(self.tokenizer)
            for line in placement_lines:
                logger.info("%s", line)
            self.pool.start(self.vocab_hash)
            self._check_one_vocabulary()
            self.rules = AdmissionRules.from_ready(self.info, self.visit, self.algorithm.resolve_request)
            self.admission: AdmissionQueue[EntryReq] = AdmissionQueue(
                {n: self.info[n].capacity_tokens for n in group.names})
            self.planner = make_planner(group, self.info, self.algorithm)
            if self.planner is not None:
                self.pool.send(group.names[1], SetThresholds(self.planner.table))
        except BaseException:
            self.close()
            raise

    # ---- the parts' state, for callers and tests ------------------------------------------------
    @property
    def info(self) -> dict[str, Ready]:
        return self.pool.info

    @property
    def procs(self) -> dict[str, Any]:
        return self.pool.procs

    @property
    def remote(self) -> dict[str, RemoteSubserver]:
        return self.pool.remote

    @property
    def entry_address(self) -> str:
        return self.pool.entry_address

    @property
    def keys(self) -> Any:
        return self.pool.keys

    @property
    def context_len(self) -> int:
        return self.rules.context_len

    @property
    def vocab_size(self) -> int:
        return self.rules.vocab_size

    @property
    def queue(self) -> Any:
        """Requests waiting for admission (a deque), oldest first."""
        return self.admission.waiting

    @property
    def reserved(self) -> dict[str, int]:
        return self.admission.reserved

    # ---- start-up ------------------------------------------------------------------------------
    def _check_one_vocabulary(self) -> None:
        """Token ids travel between models, so every model a request may visit must share the vocabulary
        (each subserver reports a hash of its own, wherever it runs)."""
        for name in self.visit:
            if self.info[name].vocab_hash != self.vocab_hash:
                raise ValueError(
                    f"models {self.algorithm.entry_model!r} and {name!r} have different vocabularies; "
                    f"{self.algorithm.name} passes token ids between models, so they must share one tokenizer")

    # ---- requests ------------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
            routing: dict[str, Any] | None = None) -> EntryReq:
        """Admit (ValueError naming the problem) and queue; see enqueue. `routing`: this request's
        overrides of the algorithm's per-request parameters."""
        return self.enqueue(self.rules.plan(prompt_ids, params, routing), rid)

    def enqueue(self, plan: AdmittedPlan, rid: str | None = None) -> EntryReq:
        """Queue an admitted request; it starts once every model it may visit has room to reserve
        its whole KV footprint, so a hand-off never finds a peer full."""
        if rid is None:
            rid = f"req-{self._next_rid}"
            self._next_rid += 1
        if rid in self.reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        self._wire_seq += 1
        req = EntryReq(rid, f"{rid}#{self._wire_seq}", plan, Reassembly.of(rid, plan, self.tokenizer,
                                                                           self.detokenize))
        self.reqs[rid] = req
        self.admission.push(req)
        self._admit()
        return req

    def _admit(self) -> None:
        try:
            while (req := self.admission.pop_admissible()) is not None:
                req.admitted = True
                if req.plan.options.model is None:  # the algorithm may have one model write it under load
                    alone = self.algorithm.alone_at(self._live())
                    if alone is not None:
                        req.plan = replace(req.plan, options=replace(req.plan.options, model=alone))
                if self.adaptation is not None:
                    req.plan = self.adaptation.start(req.wire, req.plan)
                plan = req.plan
                alone = plan.options.model  # one model writes it all: it starts there
                self.pool.send(alone or self.algorithm.entry_model,
                               AddReq(req.wire, plan.prompt_ids, plan.model_params(), plan.seed, plan.routing,
                                      plan.options.trace, alone is not None))
        finally:
            self._broadcast_active()

    def _live(self) -> int:
        """The group's live requests: admitted, not ended."""
        return len(self.reqs) - len(self.admission.waiting)

    def _broadcast_active(self) -> None:
        """Tell every subserver the group's live count (their launch thresholds depend on it)."""
        n = self._live()
        if n != self._active_sent:
            self._active_sent = n
            self.pool.broadcast(Active(n))

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is not None:
            self._end(req, "abort")

    def fail(self, rid: str, message: str) -> None:
        """End one request with an error, wherever it got to (queued or admitted)."""
        req = self.reqs.get(rid)
        if req is not None:
            req.error = message
            self._end(req, "error")

    def _end(self, req: EntryReq, reason: str, stop: int | str | None = None) -> None:
        """Finish req at the entry; tell every subserver to drop it unless one already finished it."""
        req.finish_reason, req.stop_reason = reason, stop
        req.finish_time = time.monotonic()
        req.out.finish()
        self.reqs.pop(req.rid, None)
        if self.adaptation is not None:
            self.adaptation.finish(req.wire)
        if req.admitted:
            self.admission.release(req)
            if req.final is None:
                self.pool.broadcast(Abort(req.wire))
        else:
            self.admission.withdraw(req)
        self._admit()

    def check_integrity(self) -> None:
        """The entry's one record per request: `reqs` holds each live request once, under the rid its
        wire id names; the admission queue holds exactly the live requests not yet admitted, and its
        reservations are the admitted ones' footprints; the load adaptation follows only admitted
        live requests. A leaked reservation would hold admission back for good."""
        for rid, req in self.reqs.items():
            if req.rid != rid or req.wire.rpartition("#")[0] != rid or req.done:
                raise AssertionError(f"request {rid!r}: filed as {req.rid!r} (wire {req.wire!r}), ended {req.done}")
        waiting = list(self.admission.waiting)
        if len({id(req) for req in waiting}) != len(waiting):
            raise AssertionError("a request waits for admission twice")
        for req in waiting:
            if self.reqs.get(req.rid) is not req or req.admitted:
                raise AssertionError(f"request {req.rid!r}: waits for admission but is not a live, unadmitted request")
        if sum(not req.admitted for req in self.reqs.values()) != len(waiting):
            raise AssertionError("a live request is neither admitted nor waiting for admission")
        booked = {name: 0 for name in self.admission.reserved}
        admitted = [req for req in self.reqs.values() if req.admitted]
        for req in admitted:
            for name, tokens in req.plan.reserve.items():
                booked[name] += tokens
        if booked != self.admission.reserved:
            raise AssertionError(f"KV reserved {self.admission.reserved}, the admitted requests hold {booked}")
        if self.adaptation is not None:
            stray = (self.adaptation.adapting | set(self.adaptation.window.live)) - {req.wire for req in admitted}
            if stray:
                raise AssertionError(f"load adaptation follows requests that are not live: {sorted(stray)}")

    def poll(self, timeout: float = 0.1) -> list[TokenOut | Done]:
        """Events from the subservers: each request's tokens in position order, then its Done."""
        if self._backlog:
            events, self._backlog = self._backlog, []
            return events + self._poll_once(0.0)
        return self._poll_once(timeout)

    def _poll_once(self, timeout: float) -> list[TokenOut | Done]:
        events: list[TokenOut | Done] = []
        msgs = self.pool.recv(timeout)
        t0 = time.perf_counter() if self.trace.enabled else 0.0
        for msg in msgs:
            handler = self._handlers.get(type(msg))
            if handler is not None:  # Wake carries nothing: another thread sends it to cut a poll short
                handler(msg, events)
        if self.trace.enabled:
            seconds = time.perf_counter() - t0
            tokens = sum(len(msg.items) for msg in msgs if type(msg) is Tokens)
            if tokens:
                self.trace.write_stages(-1, t0, {"reassembly": seconds, "tokens": tokens})
        if self.planner is not None:
            table = self.planner.poll()
            if table is not None:
                self.pool.send(self.group.names[1], SetThresholds(table))
        if self.adaptation is not None:
            self.adaptation.poll(time.monotonic())
        self.pool.check_alive()
        now = time.monotonic()
        if not self.reqs and now - self._checked > 1.0:
            self._checked = now
            self.check_integrity()  # idle: no reservation and no followed request may be left behind
        return events

    def _by_wire(self, wire: str) -> EntryReq | None:
        """The live request a subserver's message names. Its rid is the wire id's head (enqueue), so
        `reqs` is the one index; the whole id tells this admission from an earlier one of a reused rid,
        whose late messages are dropped."""
        req = self.reqs.get(wire.rpartition("#")[0])
        return req if req is not None and req.wire == wire else None

    def _on_tokens(self, msg: Tokens, events: list[TokenOut | Done]) -> None:
        if msg.answered and self.planner is not None:
            self.planner.answered(len(msg.items))
        for wire, n in msg.handoffs.items():
            req = self._by_wire(wire)
            if req is not None:
                req.out.handoffs = max(req.out.handoffs, n)
        for item in msg.items:
            req = self._by_wire(item.rid)
            if req is not None:
                req.out.put(item, msg.model)
                self._advance(req, events)

    def _on_prompt_logprobs(self, msg: PromptLogprobs, events: list[TokenOut | Done]) -> None:
        req = self._by_wire(msg.rid)
        if req is not None:
            req.out.prompt_logprobs = (msg.logprobs, msg.top_logprobs)
            self._advance(req, events)

    def _on_finished(self, msg: Finished, events: list[TokenOut | Done]) -> None:
        req = self._by_wire(msg.rid)
        if req is not None:
            req.final = msg
            req.out.handoffs = max(req.out.handoffs, msg.handoffs)
            self._advance(req, events)

    def _on_req_error(self, msg: ReqError, events: list[TokenOut | Done]) -> None:
        if msg.rid is None:
            raise SubserverDied(f"subserver {msg.model!r} failed: {msg.message}")
        req = self._by_wire(msg.rid)
        if req is not None:
            req.error = f"{msg.model}: {msg.message}"
            self._end(req, "error")
            events.append(req.done_event())

    def _on_stats(self, msg: Stats, events: list[TokenOut | Done]) -> None:
        self._stats[msg.model] = msg

    def _advance(self, req: EntryReq, events: list[TokenOut | Done]) -> None:
        out = req.out
        placed = len(out.tokens)
        new = out.drain()
        if self.planner is not None:
            prev = out.tokens[placed - 1].model if placed else None
            for tok in new:
                self.planner.observe(prev, tok.model, req.since_large)
                req.since_large = 0 if tok.model == self.planner.large else req.since_large + 1
                prev = tok.model
        if self.adaptation is not None and new:
            now = time.monotonic()
            for tok in new:
                self.adaptation.token(req.wire, tok.model, now)
        events.extend(new)
        if out.stop is not None:
            self._end(req, "stop", out.stop)
            events.append(req.done_event())
        elif req.final is not None and out.next_pos >= req.final.length:
            self._end(req, req.final.reason, req.final.stop_reason)
            events.append(req.done_event(out.release()))

    def stats(self, timeout: float = 5.0) -> dict[str, Stats]:
        """Ask every subserver for its counters. Events that arrive meanwhile wait for the next poll."""
        self._stats = {}
        self.pool.broadcast(StatsQuery())
        deadline = time.monotonic() + timeout
        while len(self._stats) < len(self.group.names):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no stats from {sorted(set(self.group.names) - set(self._stats))}")
            self._backlog.extend(self._poll_once(0.05))
        return dict(self._stats)

    def close(self) -> None:
        """Stop every subserver and free the sockets; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self.pool.close()
        if self.planner is not None:
            self.planner.close()
        atexit.unregister(self.close)
