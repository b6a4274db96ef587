"""A subserver: one model's engine in its own process, with the decode loop and the inter-model loop.

Decode loop: schedule -> forward -> route -> commit or send. Inter-model loop: PeerReqs out (zmq PUSH,
never blocking: zmq's I/O thread does the sending) and in (drained between steps). The scheduler and
engine know nothing of sockets; this file is the only place that joins them.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import signal
import time
import traceback
from collections import Counter
from typing import Any

import msgspec
import torch
import zmq

from tokenrouter.engine.engine import Engine, StepFailed
from tokenrouter.engine.latency_model import InterferenceClock, LatencyModelRunner
from tokenrouter.engine.launch_policy import EagerLaunch, LaunchPolicy, ThresholdLaunch, Thresholds
from tokenrouter.engine.lifetime import die_with_parent
from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.engine.req import Req
from tokenrouter.engine.step_trace import StepTraceWriter
from tokenrouter.routing import STAY, PeerReq, Route, make_algorithm
from tokenrouter.runtime.attribution import Attribution
from tokenrouter.runtime.connection_watch import ConnectionWatch
from tokenrouter.runtime.containment import checked_route, route_each
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
    decode,
    encode,
)
from tokenrouter.runtime.model_identity import vocab_hash
from tokenrouter.runtime.transport_security import secure_client, secure_server, start_authenticator

logger = logging.getLogger(__name__)

_ABORT_MEMORY_S = 300.0  # how long an aborted rid is remembered, to drop hand-offs still in flight


class Subserver:
    """One model's engine behind its sockets. Request ids on the wire are unique per admission (the
    entry makes them so): an aborted id is remembered, to drop hand-offs of it still in flight."""

    def __init__(self, spec: ModelSpec, group: GroupConfig, bind_address: str, entry_address: str,
                 parent_pid: int | None = None, advertise_host: str | None = None,
                 watch_entry: bool = False, interference_flags: str | None = None) -> None:
        """`advertise_host`: the host others reach the inbox at when it binds a wildcard interface.
        `watch_entry`: not the entry's child (joined, or a Ray actor), so exit when its connection drops.
        `interference_flags`: with the latency executor, the shared memory where the entry's co-located
        models flag their running steps."""
        self.name = spec.name
        self.parent_pid = parent_pid
        self.algorithm = make_algorithm(group.algorithm, group.names, group.algorithm_params)
        thresholds = group.launch.thresholds.get(spec.name)
        self.launch: LaunchPolicy = ThresholdLaunch(thresholds) if thresholds else EagerLaunch()
        planned = group.launch.policy == "planner"
        self.measure_latency = planned and group.planner_profile() is None
        self.clock: InterferenceClock | None = None
        runner = None
        profile = group.executor.profile if group.executor.latency else None
        if profile is not None:
            names = group.names
            alphas = {names.index(p): a for p, a in profile.interference.get(spec.name, {}).items() if p in names}
            self.clock = InterferenceClock(names.index(spec.name), alphas, interference_flags)
            runner = LatencyModelRunner.for_model(profile, spec.name, spec.engine.model_path, self.clock)
        self.engine = Engine(spec.engine, launch=self.launch, outputs=self.algorithm.outputs(spec.name),
                             latency_runner=runner)
        self.algorithm.bind(spec.name, self.engine)
        self.ctx = zmq.Context()
        self.keys = group.curve_keys()
        self._auth = start_authenticator(self.ctx, self.keys) if self.keys else None
        self.inbox = self.ctx.socket(zmq.PULL)
        secure_server(self.inbox, self.keys)
        self.inbox.bind(bind_address)  # a tcp address may end in ":*": the port is picked here
        self.address = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise_host:
            self.address = f"tcp://{advertise_host}:{self.address.rsplit(':', 1)[1]}"
        self.entry_watch: ConnectionWatch | None = None
        self.to_entry = self._push(entry_address, watch=watch_entry)
        self.to_peer: dict[str, zmq.Socket] = {}  # connected when the Topology message arrives
        # rid -> {peer: number of this request's tokens that peer holds}
        self.known: dict[str, dict[str, int]] = {}
        self.handoffs_of: dict[str, int] = {}  # rid -> its hand-offs so far (every model's, as last seen here)
        self.pending_since: dict[str, float] = {}
        self.aborted: dict[str, float] = {}
        self.prompt_logprobs_due: set[str] = set()  # requests whose prompt logprobs the entry still awaits
        self.attribution = Attribution(self.name)  # the requests that asked for a per-token trace
        self.alone: set[str] = set()  # requests this model writes alone (routing.model): never routed
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
        # Overlap (as SGLang's overlap scheduler, for the part that leaves the batch alone): a step's
        # messages to the entry wait here and go out while the next step runs, and messages that
        # arrive meanwhile are received and decoded then, and handled after it.
        self.outbox: list[tuple[zmq.Socket, Any]] = []
        self.received: list[Any] = []

    def _push(self, address: str, watch: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block the decode loop on a slow reader
        sock.setsockopt(zmq.LINGER, 1000)
        secure_client(sock, self.keys)
        if watch:
            self.entry_watch = ConnectionWatch(sock)
        sock.connect(address)
        return sock

    def _send(self, sock: zmq.Socket, msg: Any) -> None:
        sock.send(encode(msg), zmq.NOBLOCK)

    def _send_later(self, sock: zmq.Socket, msg: Any) -> None:
        """Send during the next step (or before the loop next waits), after what is already queued."""
        self.outbox.append((sock, msg))

    def _flush(self) -> None:
        outbox, self.outbox = self.outbox, []
        for sock, msg in outbox:
            self._send(sock, msg)

    def _in_flight(self) -> None:
        """Run by the executor while a step is in flight: it touches neither the batch nor the scheduler."""
        t0 = time.perf_counter()
        self._flush()
        self._receive_ready()
        self.overlap_seconds += time.perf_counter() - t0

    # ---- the loops -------------------------------------------------------------------------
    def run(self) -> None:
        eng = self.engine
        latency = None
        if self.measure_latency:
            from tokenrouter.engine.profiler import measure_engine

            latency = measure_engine(eng, (1, 4, 16), context=64, steps=3, progress=False).to_dict()
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._send(self.to_entry, Ready(self.name, self.address, os.getpid(), eng.pool.capacity_tokens,
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
            now = time.monotonic()
            if now - last_check > 1.0:
                last_check = now
                self._housekeeping(now)

    def _housekeeping(self, now: float) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.error("%s: entry process is gone, exiting", self.name)
            self.running = False
        if self.entry_watch is not None and self.entry_watch.gone():
            logger.error("%s: the connection to the entry dropped, exiting", self.name)
            self.running = False
        for rid in [r for r, t in self.aborted.items() if now - t > _ABORT_MEMORY_S]:
            del self.aborted[rid]
        if not self.engine.scheduler.has_work() and not self.engine.reqs:
            self.engine.check_integrity()

    def _drain(self, timeout_ms: int) -> None:
        if timeout_ms:
            self._flush()  # about to wait: nothing may stay unsent meanwhile
        if not self.received and not self.inbox.poll(timeout_ms):
            return
        t0 = time.perf_counter() if self.trace.enabled else 0.0
        self._receive_ready()
        received, self.received = self.received, []
        for msg in received:
            try:
                self._handle(msg)
            except Exception:  # noqa: BLE001 - one request's message must not stop the model
                rid = getattr(msg, "rid", None)
                logger.exception("%s: handling %s of request %s failed", self.name, type(msg).__name__, rid)
                if rid is not None:
                    self._fail(rid)
        if self.trace.enabled:
            self.drain_seconds += time.perf_counter() - t0

    def _receive_ready(self) -> None:
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.received.append(decode(data))
            except msgspec.DecodeError as e:  # a stray or corrupt message must not stop the model
                logger.warning("%s: dropped an undecodable message (%d bytes): %s", self.name, len(data), e)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, AddReq):
            try:
                req = self.engine.add_request(msg.tokens, msg.params, rid=msg.rid, seed=msg.seed)
            except ValueError as e:
                self._send(self.to_entry, ReqError(self.name, msg.rid, str(e)))
                return
            self.known[msg.rid] = {}
            self.handoffs_of[msg.rid] = 0
            if msg.params.prompt_logprobs is not None:
                self.prompt_logprobs_due.add(msg.rid)
            if msg.alone:
                self.alone.add(msg.rid)
            if msg.trace:
                self.attribution.start(msg.rid, scored=not msg.alone)
            self._start(req, msg.routing)
        elif isinstance(msg, Peer):
            for item in msg.items:
                try:
                    self._receive(msg.sender, item)
                except Exception:  # noqa: BLE001 - one request's hand-off must not stop the others
                    logger.exception("%s: a hand-off of request %s failed", self.name, item.req.rid)
                    self._fail(item.req.rid)
        elif isinstance(msg, Abort):
            self.aborted[msg.rid] = time.monotonic()
            if msg.rid in self.engine.reqs:
                self.aborted_requests += 1
            self._drop(msg.rid)
        elif isinstance(msg, Active):
            self.launch.group_active = msg.n
        elif isinstance(msg, SetThresholds):
            if isinstance(self.launch, ThresholdLaunch):
                self.launch.thresholds = Thresholds(msg.table)
            else:
                active = self.launch.group_active
                self.launch = ThresholdLaunch(Thresholds(msg.table))
                self.launch.group_active = active
                self.engine.scheduler.launch = self.launch
        elif isinstance(msg, Topology):
            for name, address in msg.addresses.items():
                if name != self.name and name not in self.to_peer:
                    self.to_peer[name] = self._push(address)
        elif isinstance(msg, StatsQuery):
            self._send(self.to_entry, self.stats())
        elif isinstance(msg, Shutdown):
            self.running = False

    def _fail(self, rid: str, stage: str = "step", message: str | None = None) -> None:
        """End a request this model failed on: drop it here, count it under `stage` and tell the entry
        (which aborts it on every peer). The cause is in this process's log, never in the message."""
        self.request_errors[stage] += 1
        if rid in self.engine.reqs:
            self.engine.abort(rid)
        self._drop(rid)
        message = message or f"the model {self.name!r} failed on this request"
        self._send(self.to_entry, ReqError(self.name, rid, message))

    def _algorithm_failed(self, rid: str, stage: str) -> None:
        """The routing algorithm raised in `stage` (route, send, receive, on_start, on_finish) on this
        request alone (the caller logged why): fail it, and only it."""
        self._fail(rid, stage, f"the routing algorithm {self.algorithm.name!r} failed on this request "
                               f"(in {stage} on model {self.name!r})")

    def _start(self, req: Req, routing: dict[str, Any]) -> None:
        try:
            self.algorithm.start(req, routing)
        except Exception:  # noqa: BLE001 - the algorithm failed on this request, not the model
            logger.exception("%s: %s.on_start failed on request %s", self.name, self.algorithm.name, req.rid)
            self._algorithm_failed(req.rid, "on_start")

    def _drop(self, rid: str) -> None:
        req = self.engine.reqs.get(rid)
        if req is not None:
            try:
                self.algorithm.finish(req)
            except Exception:  # noqa: BLE001 - the request ends here anyway; its state is forgotten
                logger.exception("%s: %s.on_finish failed on request %s", self.name, self.algorithm.name, rid)
                self.request_errors["on_finish"] += 1
        self.engine.abort(rid)
        self.known.pop(rid, None)
        self.handoffs_of.pop(rid, None)
        self.prompt_logprobs_due.discard(rid)
        self.attribution.forget(rid)
        self.alone.discard(rid)
        since = self.pending_since.pop(rid, None)
        if since is not None:
            self.pending_seconds += time.monotonic() - since

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
            for other in self.known.get(rid, {}):
                if other != sender:
                    self._send(self.to_peer[other], Peer(self.name, [_finish_notice(rid)]))
            self._drop(rid)
            return
        if rid in self.aborted:
            self._drop(rid)
            return
        eng = self.engine
        if rid not in eng.reqs:
            if msg.first is None:
                return  # a late hand-off of a request that already ended here
            if peer.loc != 0:
                self._send(self.to_entry, ReqError(self.name, rid, f"first visit of {rid} starts at {peer.loc}"))
                return
            try:
                req = eng.add_request(peer.suffix, msg.first.params, rid=rid, seed=msg.first.seed,
                                      prompt_len=msg.first.prompt_len)
            except ValueError as e:
                self._send(self.to_entry, ReqError(self.name, rid, str(e)))
                return
            self.known[rid] = {}
            if msg.first.trace:
                self.attribution.start(rid)
            self._start(req, msg.first.routing)
            if rid not in eng.reqs:
                return  # on_start failed on it
        else:
            eng.receive(rid, peer.loc, peer.suffix)
            since = self.pending_since.pop(rid, None)
            if since is not None:
                self.pending_seconds += time.monotonic() - since
        self.known[rid][sender] = peer.loc + len(peer.suffix)
        self.handoffs_of[rid] = msg.handoffs
        self.attribution.received(rid, msg.trace)

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
        t1 = time.perf_counter()
        took = t1 - t0
        self.step_seconds_sum += took
        self.step_buckets[bisect.bisect_left(STEP_LATENCY_BUCKETS, took)] += 1
        if not out.reqs:
            if tracing:
                self._trace_stages(t0, {"forward": took})
            return True
        routes: list[Route | None]
        try:
            routes, scores = checked_route(self.algorithm, self.name, out,
                                           traced=self.attribution.traced and self.attribution.wants(out.reqs))
        except Exception:  # noqa: BLE001 - the routing failed, not the model: find the requests it fails on
            logger.exception("%s: %s.route failed on a batch of %d; routing each alone", self.name,
                             self.algorithm.name, len(out.reqs))
            routes, scores = route_each(self.algorithm, self.name, out), None
            for req, route in zip(out.reqs, routes):
                if route is None:
                    self._algorithm_failed(req.rid, "route")
        if self.alone:
            routes = [STAY if route is not None and r.rid in self.alone else route for r, route in zip(out.reqs, routes)]
        # A request samples once its prefill is done, so its prompt logprobs are complete: they go out
        # before any of its tokens. Most steps have none due: no per-request pass then.
        if self.prompt_logprobs_due:
            for req in out.reqs:
                if req.rid in self.prompt_logprobs_due:
                    self.prompt_logprobs_due.discard(req.rid)
                    self._send_later(self.to_entry,
                                     PromptLogprobs(req.rid, req.prompt_logprobs, req.prompt_top_logprobs))
        t2 = time.perf_counter() if tracing else 0.0
        now = time.monotonic()
        events: list[TokenEvent] = []
        finished: list[Req] = []
        handoffs: list[tuple[Req, str]] = []
        for i, (req, tok, route) in enumerate(zip(out.reqs, out.token_ids, routes)):
            if route is None:
                continue  # failed in route
            if route.dest is None or route.keep:
                try:  # stop strings, grammar: per-request work that may raise on this request's data
                    eng.append_token(req, tok, now, out, i)
                    trace = self.attribution.token(req.rid, scores, i) if self.attribution.traced else None
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
                if self.attribution.traced:
                    self.attribution.handing(req.rid, route, scores, i)
                handoffs.append((req, route.dest))
        t3 = time.perf_counter() if tracing else 0.0
        self.tokens_written += len(events)
        counts = {req.rid: self.handoffs_of.get(req.rid, 0) + 1 for req, _ in handoffs}
        self.handoffs_of.update(counts)
        # Tokens first: the entry must see a request's last token no later than its finish.
        if events or counts:
            self._send_later(self.to_entry, Tokens(self.name, events, counts))
        t4 = time.perf_counter() if tracing else 0.0
        notices: dict[str, list[Handoff]] = {}
        for req in finished:
            self._finished(req, notices)
        for peer, items in notices.items():
            self._send_later(self.to_peer[peer], Peer(self.name, items))
        t5 = time.perf_counter() if tracing else 0.0
        batches: dict[str, list[Handoff]] = {}  # one message per peer and step
        for req, dest in handoffs:
            try:
                item = self._handoff(req, dest, now)
            except Exception:  # noqa: BLE001 - the algorithm failed on this request, not the model
                logger.exception("%s: %s.send failed on request %s", self.name, self.algorithm.name, req.rid)
                self._algorithm_failed(req.rid, "send")
                continue
            batches.setdefault(dest, []).append(item)
        for dest, items in batches.items():
            self._send(self.to_peer[dest], Peer(self.name, items))
        if tracing:
            self._trace_stages(t0, {"forward": took, "route": t2 - t1, "commit": t3 - t2, "tokens_msg": t4 - t3,
                                    "finish": t5 - t4, "handoff": time.perf_counter() - t5})
        return True

    def _trace_stages(self, start: float, stages: dict[str, float]) -> None:
        stages["drain"], self.drain_seconds = self.drain_seconds, 0.0
        stages["overlap"], self.overlap_seconds = self.overlap_seconds, 0.0
        self.trace.write_stages(self.index, start, stages)

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
        self.attribution.forget(req.rid)
        self.alone.discard(req.rid)
        try:
            self.algorithm.finish(req)
        except Exception:  # noqa: BLE001 - the algorithm failed on this request, not the model
            logger.exception("%s: %s.on_finish failed on request %s", self.name, self.algorithm.name, req.rid)
            self._algorithm_failed(req.rid, "on_finish")
            return
        self._send_later(self.to_entry, Finished(req.rid, self.name, req.finish_reason or "stop", stop,
                                                 len(req.tokens), self.handoffs_of.pop(req.rid, 0)))
        for peer in self.known.pop(req.rid, {}):
            notices.setdefault(peer, []).append(_finish_notice(req.rid))

    def _handoff(self, req: Req, dest: str, now: float) -> Handoff:
        """Set req PENDING; its hand-off to `dest`, to send with the step's others."""
        if dest not in self.to_peer:
            raise ValueError(f"{self.algorithm.name} routed {req.rid} to unknown model {dest!r}")
        known = self.known.setdefault(req.rid, {})
        # The prompt logprobs were this model's to compute: a peer runs without them (and so with its cache).
        first = None
        if dest not in known:
            first = FirstVisit(req.prompt_len, dataclasses.replace(req.params, prompt_logprobs=None), req.seed,
                               self.algorithm.params_of.get(req.rid, {}), req.rid in self.attribution.traced)
        peer = self.algorithm.send(req, dest, known.get(dest, 0))
        self.engine.scheduler.set_pending(req)
        self.pending_since[req.rid] = now
        self.pending_periods += 1
        self.handoffs_sent += 1
        known[dest] = peer.loc + len(peer.suffix)
        return Handoff(peer, first, self.handoffs_of[req.rid], self.attribution.sent(req.rid))

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
        )

    def close(self) -> None:
        self._flush()
        if self.engine.tp is not None:
            self.engine.tp.shutdown()  # STOP to the tensor-parallel workers, then join them
        if self.clock is not None:
            self.clock.close()
        if self.entry_watch is not None:
            self.entry_watch.close()
        for sock in (self.inbox, self.to_entry, *self.to_peer.values()):
            sock.close(linger=500)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()


def _finish_notice(rid: str) -> Handoff:
    return Handoff(PeerReq(rid=rid, suffix=[], loc=0, finished=True))


def configure_process(model: ModelSpec) -> None:
    """Threads and cores as the spec asks (oversubscribed cores make torch 5-13x slower)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model.cores:
        os.sched_setaffinity(0, model.cores)
    import torch

    if model.engine.num_threads is not None:
        torch.set_num_threads(model.engine.num_threads)


def serve_subserver(model: ModelSpec, cfg: GroupConfig, bind_address: str, entry_address: str,
                    parent_pid: int | None = None, advertise_host: str | None = None,
                    watch_entry: bool = False, interference_flags: str | None = None) -> None:
    """Load and serve until Shutdown; a failure is reported to the entry (which turns it into a clear
    error) and raised again."""
    server = None
    try:
        server = Subserver(model, cfg, bind_address, entry_address, parent_pid, advertise_host, watch_entry,
                           interference_flags)
        server.run()
    except BaseException as e:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        secure_client(sock, cfg.curve_keys())
        sock.connect(entry_address)
        msg = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
        sock.send(encode(ReqError(model.name, None, msg)))
        sock.close()
        raise
    finally:
        if server is not None:
            server.close()


def subserver_main(name: str, group: dict[str, Any], bind_address: str, entry_address: str, parent_pid: int,
                   interference_flags: str | None = None) -> None:
    """Process entry point (spawned by the entry): serve model `name` of the group (its config as
    GroupConfig.to_dict gives it); configure threads and cores, then serve."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the entry decides when we stop
    cfg = GroupConfig.from_dict(group)
    model = cfg.spec(name)
    configure_process(model)
    try:
        serve_subserver(model, cfg, bind_address, entry_address, parent_pid, interference_flags=interference_flags)
    except BaseException as e:
        raise SystemExit(1) from e
