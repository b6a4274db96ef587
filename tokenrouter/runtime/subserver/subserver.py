"""A subserver: one model's engine in its own process, with the decode loop and the inter-model loop.

Decode loop: schedule -> forward -> route -> commit or send. Inter-model loop: PeerReqs out and in
(drained between steps) through the sockets of runtime/subserver/sockets.py; each live request's
record is a RequestState (runtime/subserver/request_state.py), its hand-off state and trace. A request
starts here only through Subserver._start and ends only through Subserver._end. The scheduler and
engine know nothing of sockets; this file is the only place that joins them.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from tokenrouter.engine.engine import Engine, StepFailed
from tokenrouter.engine.latency_model import InterferenceClock, LatencyModelRunner
from tokenrouter.engine.launch_policy import EagerLaunch, LaunchPolicy, ThresholdLaunch, Thresholds
from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.engine.req import LooseVerify, Req
from tokenrouter.engine.step_board import CoreShare, StepBoard
from tokenrouter.engine.step_trace import StepTraceWriter
from tokenrouter.models import quantized_linear
from tokenrouter.routing import STAY, PeerReq, Route, RoutingAlgorithm, make_algorithm
from tokenrouter.routing.algorithm import Scores
from tokenrouter.runtime.group_config import GroupConfig, ModelSpec
from tokenrouter.runtime.messages import (
    STEP_LATENCY_BUCKETS,
    Abort,
    Active,
    AddReq,
    Finished,
    FirstVisit,
    Handoff,
    Peer,
    PromptLogprobs,
    Ready,
    ReqError,
    SetThresholds,
    Shutdown,
    Stats,
    StatsQuery,
    TokenEvent,
    Tokens,
    Topology,
    Trace,
)
from tokenrouter.runtime.model_identity import vocab_hash
from tokenrouter.runtime.subserver.request_state import RequestState, RequestStates
from tokenrouter.runtime.subserver.sockets import SubserverSockets
from tokenrouter.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Subserver:
    """One model's engine behind its sockets. Request ids on the wire are unique per admission (the
    entry makes them so): an aborted id is remembered, to drop hand-offs of it still in flight."""

    def __init__(self, spec: ModelSpec, group: GroupConfig, bind_address: str, entry_address: str,
                 parent_pid: int | None = None, advertise_host: str | None = None,
                 watch_entry: bool = False, board: str | None = None) -> None:
        """`advertise_host`: the host others reach the inbox at when it binds a wildcard interface.
        `watch_entry`: not the entry's child (joined, or a Ray actor), so exit when its connection drops.
        `board`: the shared memory where the entry's co-located models flag their running steps
        (engine/step_board.py): the latency executor's interference and core sharing read it."""
        self.name = spec.name
        self.parent_pid = parent_pid
        self.algorithm = make_algorithm(group.algorithm, group.names, group.algorithm_params)
        thresholds = group.launch.thresholds.get(spec.name)
        self.launch: LaunchPolicy = ThresholdLaunch(thresholds) if thresholds else EagerLaunch()
        planned = group.launch.policy == "planner"
        self.measure_latency = planned and group.planner_profile() is None
        self.clock: InterferenceClock | None = None
        self.board = StepBoard(board, group.names.index(spec.name)) if board else None
        runner = None
        profile = group.executor.profile if group.executor.latency else None
        if profile is not None:
            names = group.names
            alphas = {names.index(p): a for p, a in profile.interference.get(spec.name, {}).items() if p in names}
            self.clock = InterferenceClock(names.index(spec.name), alphas, self.board)
            runner = LatencyModelRunner.for_model(profile, spec.name, spec.engine.model_path, self.clock)
        cores = None
        sharing = group.core_sharing(spec.name)
        if runner is None and sharing is not None:
            cores = CoreShare(CoreShare.host_cores(), quantized_linear.MAX_ROWS, self.board,
                              max_live=1 if sharing == "colocated" else None)
        self.engine = Engine(spec.engine, launch=self.launch, outputs=self.algorithm.outputs(spec.name),
                             latency_runner=runner, trace_index=group.names.index(spec.name), cores=cores)
        self.algorithm.bind(spec.name, self.engine)
        # Run ahead for requests this model hands back with its own token (routing/algorithm.py looks_ahead).
        self.look_ahead = group.launch.look_ahead and self.algorithm.looks_ahead(spec.name)
        self.answered: list[StepOutput] = []  # rows a look-ahead sampled, for requests that came back
        self.io = SubserverSockets(self.name, group.curve_keys(), bind_address, entry_address, advertise_host,
                                   watch_entry)
        self.states = RequestStates()  # each live request's record; the aborted rids
        self.running = True
        self.handoffs_sent = self.pending_periods = self.tokens_written = 0
        self.aborted_requests = 0  # live requests ended here by an Abort (a client gone, a time limit, a peer failed)
        self.request_errors: Counter[str] = Counter()  # requests failed alone, by the stage that raised
        self.pending_seconds = 0.0
        self.step_seconds_sum = 0.0
        self.step_buckets = [0] * (len(STEP_LATENCY_BUCKETS) + 1)
        # Per-stage seconds of the runtime around each step, only while tracing (step_trace.py).
        self.trace = StepTraceWriter.from_env()
        self.index = group.names.index(spec.name)
        self.drain_seconds = 0.0  # handling inbox messages since the last step record
        self.overlap_seconds = 0.0  # work done while the last step ran
        # Each inbox message's handler, by the message's type (no message type subclasses another).
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddReq: self._on_add_req,
            Peer: self._on_peer,
            Abort: self._on_abort,
            Active: self._on_active,
            SetThresholds: self._on_set_thresholds,
            Topology: self._on_topology,
            StatsQuery: self._on_stats_query,
            Shutdown: self._on_shutdown,
        }

    def _in_flight(self) -> None:
        """Run by the executor while a step is in flight: it touches neither the batch nor the scheduler."""
        t0 = time.perf_counter()
        self.io.flush()
        self.io.receive_ready()
        self.overlap_seconds += time.perf_counter() - t0

    # ---- the loops -------------------------------------------------------------------------
    def run(self) -> None:
        eng = self.engine
        latency = None
        if self.measure_latency:
            from tokenrouter.engine.profiler import measure_engine

            latency = measure_engine(eng, (1, 4, 16), context=64, steps=3, progress=False).to_dict()
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.io.send(self.io.to_entry, Ready(self.name, self.io.address, os.getpid(), eng.pool.capacity_tokens,
                                        eng.pool.page_size, eng.max_model_len, eng.model_config.vocab_size, latency,
                                        vocab_hash(eng.tokenizer) if eng.tokenizer is not None else "",
                                        torch.get_num_threads(), affinity))
        last_check = time.monotonic()
        stepped = False
        while self.running:
            # Block on the inbox unless the last pass ran a step: requests held below the launch
            # threshold wait for a message (a hand-off, a new live count), and polling for it would
            # spin a core that the co-located model needs.
            self._drain(timeout_ms=0 if stepped else 100)
            stepped = self.running and eng.scheduler.has_work() and self._step()
            if self.board is not None:  # a peer sizing its steps reads it (engine/step_board.py CoreShare)
                self.board.hold(len(eng.reqs))
            if eng.cores is not None:
                eng.cores.routes = len(self.states.live) > self.states.alone
            now = time.monotonic()
            if now - last_check > 1.0:
                last_check = now
                self._housekeeping(now)

    def _housekeeping(self, now: float) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.error("%s: entry process is gone, exiting", self.name)
            self.running = False
        if self.io.entry_watch is not None and self.io.entry_watch.gone():
            logger.error("%s: the connection to the entry dropped, exiting", self.name)
            self.running = False
        self.states.forget_old_aborts(now)
        if not self.engine.scheduler.has_work() and not self.engine.reqs:
            self.check_integrity()  # idle: no page and no request record may be left behind

    def check_integrity(self) -> None:
        """The engine's invariants and the request records' (request_state.py), between messages and steps."""
        self.engine.check_integrity()
        self.states.check_integrity(self.engine.reqs)

    def _drain(self, timeout_ms: int) -> None:
        received = self.io.take(timeout_ms)
        if not received:
            return
        t0 = time.perf_counter() if self.trace.enabled else 0.0
        for msg in received:
            try:
                self._handle(msg)
            except Exception:  # noqa: BLE001 - one request's message must not stop the model
                rid = getattr(msg, "rid", None)
                logger.exception("%s: handling %s of request %s failed", self.name, type(msg).__name__, rid)
                if rid is not None:
                    self._fail(rid)
        if self.answered:
            rows, self.answered = self.answered, []
            rows = [row for row in rows if self.engine.reqs.get(row.reqs[0].rid) is row.reqs[0]]  # not aborted since
            if self.trace.enabled:
                self.trace.write_answered(self.index, time.perf_counter(), [row.reqs[0].rid for row in rows])
            for row in rows:
                self._commit(row, answered=True)
        if self.trace.enabled:
            self.drain_seconds += time.perf_counter() - t0

    def _handle(self, msg: Any) -> None:
        handler = self._handlers.get(type(msg))
        if handler is not None:  # a message of another type is ignored
            handler(msg)

    def _on_add_req(self, msg: AddReq) -> None:
        self._start(msg.rid, msg.tokens, msg.params, msg.seed, msg.routing, msg.trace, alone=msg.alone)

    def _on_peer(self, msg: Peer) -> None:
        for item in msg.items:
            try:
                self._receive(msg.sender, item)
            except Exception:  # noqa: BLE001 - one request's hand-off must not stop the others
                logger.exception("%s: a hand-off of request %s failed", self.name, item.req.rid)
                self._fail(item.req.rid)

    def _on_abort(self, msg: Abort) -> None:
        self.states.abort(msg.rid, time.monotonic())
        if msg.rid in self.engine.reqs:
            self.aborted_requests += 1
        self._end(msg.rid)

    def _on_active(self, msg: Active) -> None:
        self.launch.group_active = msg.n

    def _on_set_thresholds(self, msg: SetThresholds) -> None:
        if isinstance(self.launch, ThresholdLaunch):
            self.launch.thresholds = Thresholds(msg.table)
        else:
            active = self.launch.group_active
            self.launch = ThresholdLaunch(Thresholds(msg.table))
            self.launch.group_active = active
            self.engine.scheduler.launch = self.launch

    def _on_topology(self, msg: Topology) -> None:
        self.io.connect_peers(msg.addresses)

    def _on_stats_query(self, msg: StatsQuery) -> None:
        self.io.send(self.io.to_entry, self.stats())

    def _on_shutdown(self, msg: Shutdown) -> None:
        self.running = False

    def _fail(self, rid: str, stage: str = "step", message: str | None = None) -> None:
        """End a request this model failed on: drop it here, count it under `stage` and tell the entry
        (which aborts it on every peer). The cause is in this process's log, never in the message."""
        self.request_errors[stage] += 1
        self._end(rid)
        message = message or f"the model {self.name!r} failed on this request"
        self.io.send(self.io.to_entry, ReqError(self.name, rid, message))

    def _algorithm_failed(self, rid: str, stage: str) -> None:
        """The routing algorithm raised in `stage` (route, send, receive, on_start, on_finish) on this
        request alone (the caller logged why): fail it, and only it."""
        self._fail(rid, stage, f"the routing algorithm {self.algorithm.name!r} failed on this request "
                               f"(in {stage} on model {self.name!r})")

    # ---- a request's start and end on this model ----------------------------------------------
    def _start(self, rid: str, tokens: list[int], params: SamplingParams, seed: int, routing: dict[str, Any],
               traced: bool, alone: bool = False, prompt_len: int | None = None, drafts: int = 0,
               loose: LooseVerify | None = None) -> RequestState | None:
        """The one way a request starts here, from the entry (AddReq) or on its first visit from a
        peer: the engine's request, its record, then the algorithm's on_start. Its record, or None
        if it did not start (the entry was told why)."""
        try:
            req = self.engine.add_request(tokens, params, rid=rid, seed=seed, prompt_len=prompt_len, drafts=drafts,
                                          loose=loose)
        except ValueError as e:
            self.io.send(self.io.to_entry, ReqError(self.name, rid, str(e)))
            return None
        # A peer's first hand-off carries no prompt logprobs (Subserver._handoff): only the entry's model owes them.
        state = RequestState(req, prompt_logprobs_due=params.prompt_logprobs is not None, alone=alone, traced=traced)
        self.states.start(state)
        try:
            self.algorithm.start(req, routing)
        except Exception:  # noqa: BLE001 - the algorithm failed on this request, not the model
            logger.exception("%s: %s.on_start failed on request %s", self.name, self.algorithm.name, rid)
            self._algorithm_failed(rid, "on_start")
            return None
        return state

    def _end(self, rid: str) -> RequestState | None:
        """The one way a request ends here, whatever ended it (finished here or on a peer, aborted,
        failed, the engine's request live or already let go): the algorithm's on_finish, then its
        record (its trace with it) and the engine's request go. Its record, None if it had none
        (never started here, or already ended)."""
        state = self.states.end(rid)
        if state is not None:
            try:  # once per request: a no-op when _finished already told the algorithm (RoutingAlgorithm.finish)
                self.algorithm.finish(state.req)
            except Exception:  # noqa: BLE001 - the request ends here anyway; its record is forgotten
                logger.exception("%s: %s.on_finish failed on request %s", self.name, self.algorithm.name, rid)
                self.request_errors["on_finish"] += 1
            self.pending_seconds += state.end_pending(time.monotonic())
        self.engine.abort(rid)
        return state

    def _receive(self, sender: str, msg: Handoff) -> None:
        try:
            peer = self.algorithm.receive(msg.req, self.name)
        except Exception:  # noqa: BLE001 - the algorithm failed on this request, not the model
            logger.exception("%s: %s.receive failed on request %s", self.name, self.algorithm.name, msg.req.rid)
            self._algorithm_failed(msg.req.rid, "receive")
            return
        rid = peer.rid
        if peer.finished:
            # Pass the finish on to the other peers that hold a copy: with three or more models the
            # finisher may never have exchanged this request with them (m1 -> m2 -> m3 finishes).
            state = self.states.live.get(rid)
            for other in state.known if state is not None else ():
                if other != sender:
                    self.io.send(self.io.to_peer[other], Peer(self.name, [_finish_notice(rid)]))
            self._end(rid)
            return
        if rid in self.states.aborted:
            self._end(rid)
            return
        eng = self.engine
        if rid not in eng.reqs:
            if msg.first is None:
                return  # a late hand-off of a request that already ended here
            if peer.loc != 0:
                self.io.send(self.io.to_entry,
                             ReqError(self.name, rid, f"first visit of {rid} starts at {peer.loc}"))
                return
            state = self._start(rid, peer.suffix, msg.first.params, msg.first.seed, msg.first.routing,
                                msg.first.trace, prompt_len=msg.first.prompt_len, drafts=peer.draft, loose=peer.loose)
            if state is None:
                return
        else:
            state = self.states.live[rid]
            self.pending_seconds += state.end_pending(time.monotonic())
            answered = eng.receive(rid, peer.loc, peer.suffix, peer.draft, peer.loose)
            if answered is not None:
                self.answered.append(answered)
        state.known[sender] = peer.loc + len(peer.suffix)
        state.drafted = 0  # the hand-back cut our drafts where the peer stopped accepting them
        state.drafter = sender if peer.draft else None
        state.handoffs = msg.handoffs
        state.received(msg.trace)

    def _step(self) -> bool:
        """Run one step if the scheduler launches one; whether it did."""
        eng = self.engine
        tracing = self.trace.enabled
        t0 = time.perf_counter()
        try:
            out = eng.forward_step(self._in_flight)
        except StepFailed as e:
            logger.error("%s: %s", self.name, e, exc_info=e.__cause__)
            for req in e.failed:
                self._fail(req.rid)
            return True
        if out is None:
            return False
        took = time.perf_counter() - t0
        self.step_seconds_sum += took
        self.step_buckets[bisect.bisect_left(STEP_LATENCY_BUCKETS, took)] += 1
        if not out.reqs:
            if tracing:
                self._trace_stages(t0, {"forward": took})
            return True
        self._commit(out, (t0, took) if tracing else None)
        return True

    def _commit(self, out: StepOutput, timed: tuple[float, float] | None = None, answered: bool = False) -> None:
        """Route a step's sampled rows (or, `answered`, a row a look-ahead sampled), then commit their
        tokens and send their hand-offs. `timed`: the step's start and forward seconds, to trace its stages."""
        eng = self.engine
        tracing = timed is not None
        t1 = time.perf_counter()
        live = self.states.live
        routes: list[Route | None]
        try:
            routes, scores = checked_route(self.algorithm, self.name, out, traced=self.states.any_traced(out.reqs))
        except Exception:  # noqa: BLE001 - the routing failed, not the model: find the requests it fails on
            logger.exception("%s: %s.route failed on a batch of %d; routing each alone", self.name,
                             self.algorithm.name, len(out.reqs))
            routes, scores = route_each(self.algorithm, self.name, out), None
            for req, route in zip(out.reqs, routes):
                if route is None:
                    self._algorithm_failed(req.rid, "route")
        if self.states.alone:
            routes = [STAY if route is not None and live[r.rid].alone else route for r, route in zip(out.reqs, routes)]
        # A request samples once its prefill is done, so its prompt logprobs are complete: they go out
        # before any of its tokens. Most steps have none due: no per-request pass then.
        if self.states.prompt_logprobs_due:
            for req in out.reqs:
                state = live.get(req.rid)  # None: it failed in route
                if state is not None and state.prompt_logprobs_due:
                    self.states.prompt_logprobs_sent(state)
                    self.io.send_later(self.io.to_entry,
                                       PromptLogprobs(req.rid, req.prompt_logprobs, req.prompt_top_logprobs))
        t2 = time.perf_counter() if tracing else 0.0
        now = time.monotonic()
        events: list[TokenEvent] = []
        drafted: dict[str, list[TokenEvent]] = {}  # drafter -> the drafts this step accepted from it
        finished: list[Req] = []
        handoffs: list[tuple[Req, str, Trace | None]] = []  # with what each hand-off's trace carries
        for i, (req, tok, route) in enumerate(zip(out.reqs, out.token_ids, routes)):
            if route is None:
                continue  # failed in route
            state = live[req.rid]
            if out.accepted is not None and state.drafter is not None:
                try:
                    self._accept_drafts(req, now, drafted)
                except Exception:  # noqa: BLE001 - fail this request, not the step
                    logger.exception("%s: committing the drafts of request %s failed", self.name, req.rid)
                    self._fail(req.rid, "commit")
                    continue
                if req.finished:
                    finished.append(req)
                    continue
            if route.draft:
                eng.append_draft(req, tok)
                state.drafted += 1
                if route.dest is not None:
                    handoffs.append((req, route.dest, None))
                continue
            if route.dest is None or route.keep:
                try:  # stop strings, grammar: per-request work that may raise on this request's data
                    eng.append_token(req, tok, now, out, i)
                    trace = state.token_trace(scores, i)
                    if trace is not None and out.rejected is not None:
                        trace.rejected = out.rejected[i]
                    event = self._event(req, out, i, trace)
                except Exception:  # noqa: BLE001 - fail this request, not the step
                    logger.exception("%s: committing a token of request %s failed", self.name, req.rid)
                    self._fail(req.rid, "commit")
                    continue
                events.append(event)
                if req.finished:
                    finished.append(req)
                    continue
            if route.dest is not None:
                handoffs.append((req, route.dest, state.handoff_trace(self.name, route, scores, i)))
        t3 = time.perf_counter() if tracing else 0.0
        self.tokens_written += len(events)
        counts = {}
        for req, _, _ in handoffs:
            state = live[req.rid]
            state.handoffs += 1
            counts[req.rid] = state.handoffs
        # Tokens first: the entry must see a request's last token no later than its finish.
        for drafter, items in drafted.items():
            self.io.send_later(self.io.to_entry, Tokens(drafter, items))
        if events or counts:
            self.io.send_later(self.io.to_entry, Tokens(self.name, events, counts, answered))
        t4 = time.perf_counter() if tracing else 0.0
        notices: dict[str, list[Handoff]] = {}
        for req in finished:
            self._finished(req, notices)
        for peer, items in notices.items():
            self.io.send_later(self.io.to_peer[peer], Peer(self.name, items))
        t5 = time.perf_counter() if tracing else 0.0
        batches: dict[str, list[Handoff]] = {}  # one message per peer and step
        for req, dest, trace in handoffs:
            try:
                item = self._handoff(req, dest, trace)
            except Exception:  # noqa: BLE001 - the algorithm failed on this request, not the model
                logger.exception("%s: %s.send failed on request %s", self.name, self.algorithm.name, req.rid)
                self._algorithm_failed(req.rid, "send")
                continue
            batches.setdefault(dest, []).append(item)
        for dest, items in batches.items():
            self.io.send(self.io.to_peer[dest], Peer(self.name, items))
        if timed is not None:
            t0, took = timed
            self._trace_stages(t0, {"forward": took, "route": t2 - t1, "commit": t3 - t2, "tokens_msg": t4 - t3,
                                    "finish": t5 - t4, "handoff": time.perf_counter() - t5})

    def _trace_stages(self, start: float, stages: dict[str, float]) -> None:
        stages["drain"], self.drain_seconds = self.drain_seconds, 0.0
        stages["overlap"], self.overlap_seconds = self.overlap_seconds, 0.0
        self.trace.write_stages(self.index, start, stages)

    def _accept_drafts(self, req: Req, now: float, drafted: dict[str, list[TokenEvent]]) -> None:
        """req's drafts were verified this step: commit those accepted (their events go out as the
        drafter's); the drafter holds our tokens up to the first it drafted in vain."""
        state = self.states.live[req.rid]
        drafter, state.drafter = state.drafter, None
        assert drafter is not None, f"{req.rid} verified drafts from no peer"
        state.known[drafter] = min(state.known[drafter], len(req.tokens))
        n = self.engine.accept_drafts(req, now)
        end = len(req.tokens)
        trace = Trace([]) if state.traced else None
        drafted.setdefault(drafter, []).extend(
            TokenEvent(req.rid, pos, req.tokens[pos], None, None, trace) for pos in range(end - n, end))

    @staticmethod
    def _event(req: Req, out: StepOutput, row: int, trace: Trace | None = None) -> TokenEvent:
        lp = top = None
        if req.params.logprobs is not None and out.logprobs is not None:
            lp = out.logprobs[row]
            top = out.top_logprobs[row] if out.top_logprobs is not None else None
        return TokenEvent(req.rid, len(req.tokens) - 1, req.tokens[-1], lp, top, trace)

    def _finished(self, req: Req, notices: dict[str, list[Handoff]]) -> None:
        """Tell the entry (in the next step's overlap), and add a finish notice for each peer that
        holds a copy to `notices`."""
        stop = req.stop_reason if isinstance(req.stop_reason, int) else None
        try:  # here, not in _end: a failing on_finish fails a finished request (_end only logs it)
            self.algorithm.finish(req)
        except Exception:  # noqa: BLE001 - the algorithm failed on this request, not the model
            logger.exception("%s: %s.on_finish failed on request %s", self.name, self.algorithm.name, req.rid)
            self._algorithm_failed(req.rid, "on_finish")
            return
        state = self._end(req.rid)
        assert state is not None, f"{req.rid} finished with no record"
        self.io.send_later(self.io.to_entry, Finished(req.rid, self.name, req.finish_reason or "stop", stop,
                                                      len(req.tokens), state.handoffs))
        for peer in state.known:
            notices.setdefault(peer, []).append(_finish_notice(req.rid))

    def _handoff(self, req: Req, dest: str, trace: Trace | None) -> Handoff:
        """Hand req to `dest` (PENDING here, or first its look-ahead row), its hand-off carrying
        `trace`; the hand-off, to send with the step's others."""
        if dest not in self.io.to_peer:
            raise ValueError(f"{self.algorithm.name} routed {req.rid} to unknown model {dest!r}")
        state = self.states.live[req.rid]
        known = state.known
        # The prompt logprobs were this model's to compute: a peer runs without them (and so with its cache).
        first = None
        if dest not in known:
            first = FirstVisit(req.prompt_len, dataclasses.replace(req.params, prompt_logprobs=None), req.seed,
                               self.algorithm.params_of.get(req.rid, {}), state.traced)
        peer = self.algorithm.send(req, dest, known.get(dest, 0))
        if state.drafted:
            if len(peer.suffix) < state.drafted or peer.loc + len(peer.suffix) != len(req.tokens):
                raise ValueError(f"{self.algorithm.name}.send: the hand-off of {req.rid} must end with "
                                 f"its {state.drafted} drafts")
            peer.draft, state.drafted = state.drafted, 0
        self.engine.hand_off(req, self.look_ahead)
        state.at_peer = True
        self.pending_periods += 1
        self.handoffs_sent += 1
        known[dest] = peer.loc + len(peer.suffix)
        return Handoff(peer, first, state.handoffs, trace)

    def stats(self) -> Stats:
        eng = self.engine
        return Stats(
            model=self.name, steps=eng.stats.steps, tokens_written=self.tokens_written,
            extended_tokens=eng.stats.extended_tokens, handoffs_sent=self.handoffs_sent,
            pending_periods=self.pending_periods, pending_seconds=self.pending_seconds,
            preemptions=eng.scheduler.num_preemptions, free_pages=eng.pool.num_free,
            cached_pages=eng.cache.total_pages, total_pages=eng.pool.num_pages,
            live_requests=len(eng.reqs), waiting_requests=len(eng.scheduler.waiting),
            step_seconds_sum=self.step_seconds_sum, step_buckets=list(self.step_buckets),
            aborted_requests=self.aborted_requests, request_errors=dict(self.request_errors),
            look_aheads=eng.stats.look_aheads, look_ahead_hits=eng.stats.look_ahead_hits,
            drafts_verified=eng.stats.drafts_verified, drafts_accepted=eng.stats.drafts_accepted,
            threaded_steps=eng.cores.threaded_steps if eng.cores is not None else 0,
        )

    def close(self) -> None:
        self.io.flush()
        if self.engine.tp is not None:
            self.engine.tp.shutdown()  # STOP to the tensor-parallel workers, then join them
        if self.board is not None:
            self.board.close()
        self.io.close()


def _finish_notice(rid: str) -> Handoff:
    return Handoff(PeerReq(rid=rid, suffix=[], loc=0, finished=True))


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
    """Route each request of `step` alone, after `route` raised on the whole batch (as the engine
    contains a failed step): its Route, or None for a request that raises alone; when none raises
    alone the batch as a whole failed: all None. A request's decision reads only its own row, its own
    parameters and its own state, and the built-in algorithms' draws are keyed by (request seed,
    position), never by the batch: a request routed alone gets the decision it would have got in it."""
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
