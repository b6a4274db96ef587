"""The group's subservers as processes: started here (spawned, or as Ray actors) or joined from other
hosts, the sockets to and from them, and their liveness. Knows nothing of requests."""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from tokenrouter.engine.step_board import colocated_spin, create_board
from tokenrouter.runtime.connection_watch import ConnectionWatch
from tokenrouter.runtime.entry.join_desk import JoinDesk, JoinedSubserver
from tokenrouter.runtime.entry.remote_subserver import RemoteSubserver
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Join, Ready, ReqError, Shutdown, Topology, encode, receive_waiting
from tokenrouter.runtime.subserver.process import subserver_main
from tokenrouter.runtime.transport_security import secure_client, secure_server, start_authenticator

logger = logging.getLogger(__name__)


class SubserverDied(RuntimeError):
    """A subserver process exited or failed; the group cannot go on."""


class SubserverPool:
    """Binds the entry's inbox at construction; `start` brings every subserver up and connects to it."""

    def __init__(self, group: GroupConfig) -> None:
        self.group = group
        self.dir = tempfile.mkdtemp(prefix="tokenrouter-")
        tag = uuid.uuid4().hex[:8]
        if group.transport == "ipc":
            self.bind_addresses = {n: f"ipc://{self.dir}/{n}-{tag}" for n in group.names}
            entry_bind = f"ipc://{self.dir}/entry-{tag}"
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
        self._last_liveness = 0.0
        self._board: Any = None  # the step board of the subservers spawned here (engine/step_board.py)
        # Each start-up message's handler, by the message's type (no message type subclasses another).
        self._startup_handlers: dict[type, Callable[[Any], None]] = {
            Ready: self._ready,
            Join: self._on_join,
            ReqError: self._on_startup_error,
        }

    @property
    def board_name(self) -> str | None:
        """The step board's shared-memory name (a StepBoard reads it), None before start."""
        return self._board.name if self._board is not None else None

    def start(self, vocab_hash: str) -> None:
        """Start every subserver and wait (bounded) until each has loaded its model; joiners are
        checked against `vocab_hash`. Raises SubserverDied when one fails or is late."""
        spawn = mp.get_context("spawn")
        group_dict = self.group.to_dict()
        self._board = create_board()  # their running steps: interference, core sharing
        board = self._board.name
        for spec in self.group.models:
            if spec.start == "spawn":
                proc = spawn.Process(
                    target=subserver_main, name=f"tokenrouter-{spec.name}",
                    args=(spec.name, group_dict, self.bind_addresses[spec.name], self.entry_address, os.getpid(),
                          board))
                with colocated_spin(self.group.core_sharing(spec.name) == "colocated"):
                    proc.start()
                self.procs[spec.name] = proc
            elif spec.start == "ray":
                from tokenrouter.runtime.entry.ray_subserver import RaySubserver

                self.remote[spec.name] = RaySubserver(spec, group_dict, self.entry_address, self.group.ray)
        joining = [m.name for m in self.group.models if m.start == "join"]
        if joining:
            self.joins = JoinDesk(self.group, self.ctx, self.keys, vocab_hash)
            logger.info("waiting up to %.0f s for %s to join: on its host run `tokenrouter subserver --join %s "
                        "--name NAME`", self.group.join_timeout, ", ".join(joining), self.entry_address)
        started = time.monotonic()
        while len(self.info) < len(self.group.models):
            self._check_startup(started)
            for msg in self.recv(timeout=0.2):
                handler = self._startup_handlers.get(type(msg))
                if handler is not None:  # a message of another type is ignored
                    handler(msg)
            self.check_alive(force=True)
        self.broadcast(Topology({n: r.address for n, r in self.info.items()}))
        for name, r in self.info.items():
            spec = self.group.spec(name)
            logger.info("model %r (%s, %s): KV pool %d tokens in %d pages of %d, context %d, inbox %s", name,
                        spec.start, spec.engine.device, r.capacity_tokens, r.capacity_tokens // r.page_size,
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
        if self.group.spec(name).start != "join":
            return started
        assert self.joins is not None
        return self.joins.joined[name][0] if name in self.joins.joined else math.inf

    def _on_join(self, msg: Join) -> None:
        if self.joins is not None:  # no model of the group joins: a stray Join is ignored
            self.joins.handle(msg)

    def _on_startup_error(self, msg: ReqError) -> None:
        if msg.rid is None:  # the subserver itself failed (no request is in flight before start-up ends)
            raise SubserverDied(f"subserver {msg.model!r} failed to start: {msg.message}")

    def _ready(self, msg: Ready) -> None:
        """Connect to a subserver that has loaded its model. A joined one is accepted only after its Join
        passed the checks, and is watched through this connection (it is not our child)."""
        start = self.group.spec(msg.model).start if msg.model in self.group.names else None
        if start is None or msg.model in self.info or (
                start == "join" and (self.joins is None or msg.model not in self.joins.joined)):
            logger.warning("entry: ignored an unexpected Ready from %r at %s", msg.model, msg.address)
            return
        self.info[msg.model] = msg
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 500)
        secure_client(sock, self.keys)
        if start == "join":
            self.remote[msg.model] = JoinedSubserver(msg.model, msg.address, ConnectionWatch(sock))
        sock.connect(msg.address)
        self.outbox[msg.model] = sock

    def check_alive(self, force: bool = False) -> None:
        """Raise SubserverDied if a subserver is gone (looked at every 0.5 s unless forced)."""
        now = time.monotonic()
        if not force and now - self._last_liveness < 0.5:
            return
        self._last_liveness = now
        gone = [(n, f"subserver {n!r} (pid {p.pid}) exited with code {p.exitcode}")
                for n, p in self.procs.items() if not p.is_alive()]
        gone += [(n, why) for n, h in self.remote.items() if (why := h.failure()) is not None]
        if gone:
            # A crash report may be on its way; prefer its message to the bare exit code.
            for msg in self.recv(timeout=0.2):
                if isinstance(msg, ReqError) and msg.rid is None:
                    raise SubserverDied(f"subserver {msg.model!r} failed: {msg.message}")
            raise SubserverDied(gone[0][1])

    def recv(self, timeout: float) -> list[Any]:
        """Every message waiting on the inbox, after waiting up to `timeout` seconds for the first."""
        return receive_waiting(self.inbox, "entry") if self.inbox.poll(int(timeout * 1000)) else []

    def send(self, model: str, msg: Any) -> None:
        self.outbox[model].send(encode(msg), zmq.NOBLOCK)

    def broadcast(self, msg: Any) -> None:
        for name in self.group.names:
            self.send(name, msg)

    def close(self) -> None:
        """Stop every subserver (Shutdown, then kill after a grace period) and free the sockets."""
        for name in self.outbox:
            try:
                self.send(name, Shutdown())
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
        if self._board is not None:
            self._board.close()
            self._board.unlink()
        shutil.rmtree(self.dir, ignore_errors=True)
