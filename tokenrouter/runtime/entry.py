"""The entry: starts the subservers, admits requests, and reassembles their tokens in order.

The client loop: new requests and aborts go out to the subservers; committed tokens (each with its
absolute position and the model that wrote it) and finishes come back. Tokens from different models
may arrive out of order, so each request keeps a small buffer keyed by position. Stop strings are
detected here, where the whole text is, and end the request everywhere. No HTTP: the offline API and
the server both drive this class.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import zmq

from tokenrouter.engine.latency_model import StepLatency, create_flags
from tokenrouter.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from tokenrouter.planner.controller import PlannerController
from tokenrouter.routing import make_algorithm
from tokenrouter.runtime.connection_watch import ConnectionWatch
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import (
    Abort,
    Active,
    AddReq,
    Finished,
    Join,
    Ready,
    ReqError,
    SetThresholds,
    Shutdown,
    Stats,
    StatsQuery,
    TokenEvent,
    Tokens,
    Topology,
    decode,
    encode,
)
from tokenrouter.runtime.model_identity import vocab_hash
from tokenrouter.runtime.placement import plan_placement
from tokenrouter.runtime.remote.join_desk import JoinDesk, JoinedSubserver
from tokenrouter.runtime.remote.remote_subserver import RemoteSubserver
from tokenrouter.runtime.subserver import subserver_main
from tokenrouter.runtime.transport_security import secure_client, secure_server, start_authenticator
from tokenrouter.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class SubserverDied(RuntimeError):
    """A subserver process exited or failed; the group cannot go on."""


@dataclass(eq=False)
class EntryReq:
    rid: str  # the caller's id
    wire: str  # the id on the wire: unique per admission, so a reused rid never meets stale messages
    prompt_ids: list[int]
    params: SamplingParams  # as the client sent them (stop strings included)
    seed: int
    max_tokens: int  # capped by the group's context
    reserve: dict[str, int]  # KV tokens reserved on each model the request may visit (none for one model)
    output: list[int] = field(default_factory=list)
    models: list[str] = field(default_factory=list)  # who wrote each output token
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    buffer: dict[int, tuple[TokenEvent, str]] = field(default_factory=dict)
    final: Finished | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    detok: IncrementalDetokenizer | None = None
    text: str | None = None  # final text when a stop string cut it
    admitted: bool = False
    released: int = 0  # characters of text already handed out as deltas
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def next_pos(self) -> int:
        return len(self.prompt_ids) + len(self.output)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def handoffs(self) -> int:
        return sum(a != b for a, b in zip(self.models, self.models[1:]))


class EntryEvent(NamedTuple):
    kind: str  # "token" or "finished"
    req: EntryReq
    token: int | None = None
    model: str | None = None
    text: str = ""  # newly released text (detokenizing entries only; never a broken character)


class Entry:
    """Owns the subserver processes and the request table; raises SubserverDied when one dies."""

    def __init__(self, group: GroupConfig, detokenize: bool = False) -> None:
        """`detokenize`: release text deltas with token events (streaming servers). Text that could
        still become a stop string is held back until it cannot."""
        self.group = group
        self.detokenize = detokenize
        self.algorithm = make_algorithm(group.algorithm, group.names, group.algorithm_params)
        self.visit = self.algorithm.may_visit()
        self._dir = tempfile.mkdtemp(prefix="tokenrouter-")
        tag = uuid.uuid4().hex[:8]
        if group.transport == "ipc":
            self.bind_addresses = {n: f"ipc://{self._dir}/{n}-{tag}" for n in group.names}
            entry_bind = f"ipc://{self._dir}/entry-{tag}"
        else:
            self.bind_addresses = {m.name: f"tcp://{m.host}:{m.port or '*'}" for m in group.models}
            entry_bind = f"tcp://{group.entry_host}:{group.entry_port or '*'}"
        self.ctx = zmq.Context()
        self.keys = group.curve_keys()
        self._auth = start_authenticator(self.ctx, self.keys) if self.keys else None
        self.inbox = self.ctx.socket(zmq.PULL)
        secure_server(self.inbox, self.keys)
        self.inbox.bind(entry_bind)
        self.entry_address = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outbox: dict[str, zmq.Socket] = {}  # connected as each subserver reports its address
        self.procs: dict[str, Any] = {}  # the subservers spawned here (multiprocessing.Process)
        self.remote: dict[str, RemoteSubserver] = {}  # joined or Ray-launched ones
        self.joins: JoinDesk | None = None
        self.info: dict[str, Ready] = {}
        self.reqs: dict[str, EntryReq] = {}  # by caller's rid
        self._by_wire: dict[str, EntryReq] = {}
        self._wire_seq = 0
        self.queue: list[EntryReq] = []
        self.reserved = {n: 0 for n in group.names}
        self._next_rid = 0
        self._closed = False
        self._last_liveness = 0.0
        self._backlog: list[EntryEvent] = []
        self._stats: dict[str, Stats] = {}
        self._active_sent = 0
        self._flags: Any = None
        atexit.register(self.close)
        try:
            # Before the subservers: joiners are checked against the entry model's vocabulary.
            self.tokenizer = load_tokenizer(group.spec(self.algorithm.entry_model).path)
            self.vocab_hash = vocab_hash(self.tokenizer)
            self._start()
            self._check_one_vocabulary()
        except BaseException:
            self.close()
            raise
        self.context_len = min(self.info[n].max_model_len for n in self.visit)
        self.vocab_size = min(self.info[n].vocab_size for n in self.visit)
        self.planner = self._make_planner()

    def _make_planner(self) -> PlannerController | None:
        """With launch policy "planner": plan the large model's B(n) from step latencies (a profile,
        or the subservers' start-up measurements) and the routing probability seen online."""
        launch = self.group.launch
        if launch.get("policy") != "planner":
            return None
        small, large = self.group.names
        prof = self.group.planner_profile()
        lat = {}
        for name in (small, large):
            if prof is not None:
                lat[name] = prof.models[name]
            elif self.info[name].latency is not None:
                lat[name] = StepLatency.from_dict(self.info[name].latency)
            else:
                raise ValueError(f"no step latency for {name!r}: give the planner a profile")
        n_max = int(launch.get("n_max", min(64, self.group.spec(small).max_running_requests)))
        ctl = PlannerController(small, large, lambda b: lat[small](b, b), lambda b: lat[large](b, b),
                                float(launch.get("alpha", 0.0)), n_max, p0=float(launch.get("p", 0.1)))
        self._send(large, SetThresholds(ctl.table))
        return ctl

    def _check_one_vocabulary(self) -> None:
        """Token ids travel between models, so every model a request may visit must share the vocabulary
        (each subserver reports a hash of its own, wherever it runs)."""
        for name in self.visit:
            if self.info[name].vocab_hash != self.vocab_hash:
                raise ValueError(
                    f"models {self.algorithm.entry_model!r} and {name!r} have different vocabularies; "
                    f"{self.algorithm.name} passes token ids between models, so they must share one tokenizer")

    # ---- processes -------------------------------------------------------------------------
    def _start(self) -> None:
        spawn = mp.get_context("spawn")
        for line in plan_placement(self.group):  # fixes co-located models' KV budgets before they start
            logger.info("%s", line)
        group_dict = self.group.to_dict()
        if self.group.executor.get("mode") == "latency":
            self._flags = create_flags()  # co-located models' running flags, for interference
            group_dict["executor"] = {**group_dict["executor"], "flags": self._flags.name,
                                      "profile": self.group.latency_profile().to_dict()}
        for spec in self.group.models:
            if spec.launcher == "spawn":
                proc = spawn.Process(
                    target=subserver_main, name=f"tokenrouter-{spec.name}",
                    args=(dataclasses.asdict(spec), group_dict, self.bind_addresses[spec.name], self.entry_address,
                          os.getpid()))
                proc.start()
                self.procs[spec.name] = proc
            elif spec.launcher == "ray":
                from tokenrouter.runtime.remote.ray_actor import RaySubserver

                self.remote[spec.name] = RaySubserver(spec, group_dict, self.entry_address, self.group.ray)
        joining = [m.name for m in self.group.models if m.launcher == "join"]
        if joining:
            self.joins = JoinDesk(self.group, self.ctx, self.keys, self.vocab_hash)
            logger.info("waiting up to %.0f s for %s to join: on its host run `tokenrouter subserver --join %s "
                        "--name NAME`", self.group.join_timeout, ", ".join(joining), self.entry_address)
        started = time.monotonic()
        while len(self.info) < len(self.group.models):
            self._check_startup(started)
            for msg in self._recv(timeout=0.2):
                if isinstance(msg, Ready):
                    self._ready(msg)
                elif isinstance(msg, Join) and self.joins is not None:
                    self.joins.handle(msg)
                elif isinstance(msg, ReqError) and msg.rid is None:
                    raise SubserverDied(f"subserver {msg.model!r} failed to start: {msg.message}")
            self._check_alive(force=True)
        topology = Topology({n: r.address for n, r in self.info.items()})
        for name in self.group.names:
            self._send(name, topology)
        for name, r in self.info.items():
            spec = self.group.spec(name)
            logger.info("model %r (%s, %s): KV pool %d tokens in %d pages of %d, context %d, inbox %s", name,
                        spec.launcher, spec.device, r.capacity_tokens, r.capacity_tokens // r.page_size,
                        r.page_size, r.max_model_len, r.address)

    def _check_startup(self, started: float) -> None:
        """Bounded waits: for joiners to join, then for every subserver to load its model."""
        now = time.monotonic()
        late = [n for n in self.group.names if n not in self.info and now - self._started_at(n, started)
                > self.group.startup_timeout]
        if late:
            raise SubserverDied(f"subserver(s) {', '.join(late)} not ready after {self.group.startup_timeout:.0f} s")
        if self.joins is not None and self.joins.waiting and now - started > self.group.join_timeout:
            raise SubserverDied(
                f"model(s) {', '.join(self.joins.waiting)} did not join within {self.group.join_timeout:.0f} s: "
                f"on its host run `tokenrouter subserver --join {self.entry_address} --name NAME` with the "
                "group's secret")

    def _started_at(self, name: str, started: float) -> float:
        if self.group.spec(name).launcher != "join":
            return started
        assert self.joins is not None
        return self.joins.joined[name][0] if name in self.joins.joined else math.inf

    def _ready(self, msg: Ready) -> None:
        """Connect to a subserver that has loaded its model. A joined one is accepted only after its Join
        passed the checks, and is watched through this connection (it is not our child)."""
        launcher = self.group.spec(msg.model).launcher if msg.model in self.group.names else None
        if launcher is None or msg.model in self.info or (
                launcher == "join" and (self.joins is None or msg.model not in self.joins.joined)):
            logger.warning("entry: ignored an unexpected Ready from %r at %s", msg.model, msg.address)
            return
        self.info[msg.model] = msg
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 500)
        secure_client(sock, self.keys)
        if launcher == "join":
            self.remote[msg.model] = JoinedSubserver(msg.model, msg.address, ConnectionWatch(sock))
        sock.connect(msg.address)
        self.outbox[msg.model] = sock

    def _check_alive(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_liveness < 0.5:
            return
        self._last_liveness = now
        gone = [(n, f"subserver {n!r} (pid {p.pid}) exited with code {p.exitcode}")
                for n, p in self.procs.items() if not p.is_alive()]
        gone += [(n, why) for n, h in self.remote.items() if (why := h.failure()) is not None]
        if gone:
            # A crash report may be on its way; prefer its message to the bare exit code.
            for msg in self._recv(timeout=0.2):
                if isinstance(msg, ReqError) and msg.rid is None:
                    raise SubserverDied(f"subserver {msg.model!r} failed: {msg.message}")
            raise SubserverDied(gone[0][1])

    def _recv(self, timeout: float) -> list[Any]:
        msgs = []
        if self.inbox.poll(int(timeout * 1000)):
            while True:
                try:
                    data = self.inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msgs.append(decode(data))
                except msgspec.DecodeError as e:  # a stray or corrupt message must not stop the entry
                    logger.warning("entry: dropped an undecodable message (%d bytes): %s", len(data), e)
        return msgs

    def _send(self, model: str, msg: Any) -> None:
        self.outbox[model].send(encode(msg), zmq.NOBLOCK)

    # ---- requests --------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> dict[str, int]:
        """Raise ValueError naming what is wrong; else return the KV tokens to reserve per model.
        Reads only constants, so any thread may call it."""
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt is empty: a request needs at least one token")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        params.check_vocab(self.vocab_size)
        if len(prompt_ids) >= self.context_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, but the context is {self.context_len} tokens")
        max_tokens = min(params.max_tokens, self.context_len - len(prompt_ids))
        reserve = {}
        for name in self.visit:
            page = self.info[name].page_size
            reserve[name] = math.ceil((len(prompt_ids) + max_tokens) / page) * page
            if reserve[name] > self.info[name].capacity_tokens:
                raise ValueError(f"request needs {reserve[name]} tokens of KV on model {name!r}, "
                                 f"whose pool holds {self.info[name].capacity_tokens}")
        # A request that never leaves one model needs no reservation: that model's scheduler admits
        # what fits and preempts (recompute) under pressure, as a single-model server does. Only
        # hand-offs need room guaranteed ahead, because a PENDING request cannot be preempted.
        return reserve if len(self.visit) > 1 else {}

    def add(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> EntryReq:
        """Validate (ValueError naming the problem) and queue; admitted when every model it may
        visit has room to reserve its whole KV footprint, so a hand-off never finds a peer full."""
        reserve = self.validate(prompt_ids, params)
        if rid is None:
            rid = f"req-{self._next_rid}"
            self._next_rid += 1
        if rid in self.reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        max_tokens = min(params.max_tokens, self.context_len - len(prompt_ids))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._wire_seq += 1
        req = EntryReq(rid, f"{rid}#{self._wire_seq}", list(prompt_ids), params, seed, max_tokens, reserve)
        if params.stop or self.detokenize:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)
        self.reqs[rid] = req
        self._by_wire[req.wire] = req
        self.queue.append(req)
        self._admit()
        return req

    def _broadcast_active(self) -> None:
        """Tell every subserver the group's live count (their launch thresholds depend on it)."""
        n = len(self.reqs) - len(self.queue)
        if n != self._active_sent:
            self._active_sent = n
            for name in self.group.names:
                self._send(name, Active(n))

    def _admit(self) -> None:
        try:
            self._admit_queued()
        finally:
            self._broadcast_active()

    def _admit_queued(self) -> None:
        while self.queue:
            req = self.queue[0]
            if any(self.reserved[n] + t > self.info[n].capacity_tokens for n, t in req.reserve.items()):
                return
            self.queue.pop(0)
            for n, t in req.reserve.items():
                self.reserved[n] += t
            req.admitted = True
            # Stop strings stay here; the models see the capped max_tokens.
            sub = dataclasses.replace(req.params, stop=[], max_tokens=req.max_tokens)
            self._send(self.algorithm.entry_model, AddReq(req.wire, req.prompt_ids, sub, req.seed))

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        self._end(req, "abort")

    def end_with_error(self, rid: str, message: str) -> EntryReq | None:
        req = self.reqs.get(rid)
        return self._end_with_error(req, message) if req is not None else None

    def _end_with_error(self, req: EntryReq, message: str) -> EntryReq:
        req.error = message
        self._end(req, "error")
        return req

    def _end(self, req: EntryReq, reason: str, stop: int | str | None = None) -> None:
        """Finish req at the entry; tell every subserver to drop it unless one already finished it."""
        req.finish_reason, req.stop_reason = reason, stop
        req.finish_time = time.monotonic()
        if req.detok is not None and req.text is None:
            req.text = req.detok.text
        self.reqs.pop(req.rid, None)
        self._by_wire.pop(req.wire, None)
        if req.admitted:
            for n, t in req.reserve.items():
                self.reserved[n] -= t
            if req.final is None:
                for name in self.group.names:
                    self._send(name, Abort(req.wire))
        elif req in self.queue:
            self.queue.remove(req)
        self._admit()

    def poll(self, timeout: float = 0.1) -> list[EntryEvent]:
        """Events (tokens in position order, finishes) from the subservers."""
        if self._backlog:
            events, self._backlog = self._backlog, []
            return events + self._poll_once(0.0)
        return self._poll_once(timeout)

    def _poll_once(self, timeout: float) -> list[EntryEvent]:
        events: list[EntryEvent] = []
        for msg in self._recv(timeout):
            if isinstance(msg, Tokens):
                for item in msg.items:
                    req = self._by_wire.get(item.rid)
                    if req is not None and item.pos >= req.next_pos:
                        req.buffer[item.pos] = (item, msg.model)
                        self._advance(req, events)
            elif isinstance(msg, Finished):
                req = self._by_wire.get(msg.rid)
                if req is not None:
                    req.final = msg
                    self._advance(req, events)
            elif isinstance(msg, ReqError):
                if msg.rid is None:
                    raise SubserverDied(f"subserver {msg.model!r} failed: {msg.message}")
                req = self._by_wire.get(msg.rid)
                if req is not None:
                    self._end_with_error(req, f"{msg.model}: {msg.message}")
                    events.append(EntryEvent("finished", req))
            elif isinstance(msg, Stats):
                self._stats[msg.model] = msg
            # Wake carries nothing: another thread sends it to cut a poll short.
        if self.planner is not None:
            table = self.planner.poll()
            if table is not None:
                self._send(self.group.names[1], SetThresholds(table))
        self._check_alive()
        return events

    def _advance(self, req: EntryReq, events: list[EntryEvent]) -> None:
        while req.next_pos in req.buffer and not req.done:
            item, model = req.buffer.pop(req.next_pos)
            if self.planner is not None:
                self.planner.observe(req.models[-1] if req.models else None, model)
            req.output.append(item.token)
            req.models.append(model)
            if item.logprob is not None:
                req.logprobs.append(item.logprob)
                req.top_logprobs.append(item.top_logprobs or {})
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.detok is not None and self._stop_string_hit(req, item.token):
                events.append(EntryEvent("token", req, item.token, model, self._release(req)))
                events.append(EntryEvent("finished", req))
                return
            events.append(EntryEvent("token", req, item.token, model, self._release(req)))
        if req.final is not None and req.next_pos >= req.final.length and not req.done:
            self._end(req, req.final.reason, req.final.stop_reason)
            events.append(EntryEvent("finished", req, text=self._release(req)))

    def _release(self, req: EntryReq) -> str:
        """Text not yet handed out, less a tail that could still grow into a stop string."""
        if not self.detokenize or req.detok is None:
            return ""
        text = req.text if req.text is not None else req.detok.text
        hold = 0 if req.done else max((len(s) - 1 for s in req.params.stop), default=0)
        end = max(req.released, len(text) - hold)
        out, req.released = text[req.released:end], end
        return out

    def _stop_string_hit(self, req: EntryReq, token: int) -> bool:
        assert req.detok is not None
        new = req.detok.add([token])
        if not new or len(req.output) <= req.params.min_tokens:  # as vLLM: no stop string before min_tokens
            return False
        text = req.detok.text
        for stop in req.params.stop:
            pos = text.find(stop, max(0, len(text) - len(new) - len(stop) + 1))
            if pos != -1:
                keep = pos + (len(stop) if req.params.include_stop_str_in_output else 0)
                req.text = text[:keep]
                self._end(req, "stop", stop)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def stats(self, timeout: float = 5.0) -> dict[str, Stats]:
        """Ask every subserver for its counters. Events that arrive meanwhile wait for the next poll."""
        self._stats = {}
        for name in self.group.names:
            self._send(name, StatsQuery())
        deadline = time.monotonic() + timeout
        while len(self._stats) < len(self.group.names):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no stats from {sorted(set(self.group.names) - set(self._stats))}")
            self._backlog.extend(self._poll_once(0.05))
        return dict(self._stats)

    def close(self) -> None:
        """Stop every subserver (Shutdown, then kill after a grace period) and free the sockets."""
        if self._closed:
            return
        self._closed = True
        for name in self.outbox:
            try:
                self._send(name, Shutdown())
            except zmq.ZMQError:
                pass
        for name, proc in self.procs.items():
            if name not in self.outbox:
                proc.terminate()  # never reported ready: nothing to drain
        for name, handle in self.remote.items():
            if name not in self.outbox:
                handle.kill()
        deadline = time.monotonic() + 5.0
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for name, handle in self.remote.items():
            if name in self.outbox and not handle.wait(max(0.0, deadline - time.monotonic())):
                handle.kill()
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for handle in self.remote.values():
            handle.close()
        for sock in (self.inbox, *self.outbox.values()):
            sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        if getattr(self, "planner", None) is not None:
            self.planner.close()
        if self._flags is not None:
            self._flags.close()
            self._flags.unlink()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.close)
