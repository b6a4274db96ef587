"""A subserver's sockets and message pump: its inbox (PULL), its pushes to the entry and to each peer,
the messages waiting to go out during the next step, and those received meanwhile.

Sends never block the decode loop (zmq PUSH with no high-water mark: zmq's I/O thread does the
sending). Messages are tagged msgspec structs (runtime/messages.py); a message that does not decode is
dropped with a warning, and the model serves on.
"""

from __future__ import annotations

from typing import Any

import zmq

from tokenrouter.runtime.connection_watch import ConnectionWatch
from tokenrouter.runtime.messages import encode, receive_waiting
from tokenrouter.runtime.transport_security import CurveKeys, secure_client, secure_server, start_authenticator


class SubserverSockets:
    """Owns the zmq context and every socket of one subserver; the subserver's loop thread only."""

    def __init__(self, name: str, keys: CurveKeys | None, bind_address: str, entry_address: str,
                 advertise_host: str | None = None, watch_entry: bool = False) -> None:
        """`advertise_host`: the host others reach the inbox at when it binds a wildcard interface.
        `watch_entry`: watch the connection to the entry (a subserver that is not the entry's child)."""
        self.name = name
        self.ctx = zmq.Context()
        self.keys = keys
        self.auth = start_authenticator(self.ctx, keys) if keys else None
        self.inbox = self.ctx.socket(zmq.PULL)
        secure_server(self.inbox, keys)
        self.inbox.bind(bind_address)  # a tcp address may end in ":*": the port is picked here
        self.address = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise_host:
            self.address = f"tcp://{advertise_host}:{self.address.rsplit(':', 1)[1]}"
        self.entry_watch: ConnectionWatch | None = None
        self.to_entry = self.push(entry_address, watch=watch_entry)
        self.to_peer: dict[str, zmq.Socket] = {}  # connected when the Topology message arrives
        # Overlap (as SGLang's overlap scheduler, for the part that leaves the batch alone): a step's
        # messages to the entry wait here and go out while the next step runs, and messages that
        # arrive meanwhile are received and decoded then, and handled after it.
        self.outbox: list[tuple[zmq.Socket, Any]] = []
        self.received: list[Any] = []

    def push(self, address: str, watch: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block the decode loop on a slow reader
        sock.setsockopt(zmq.LINGER, 1000)
        secure_client(sock, self.keys)
        if watch:  # the entry's connection: attached before connect, to see its handshake
            self.entry_watch = ConnectionWatch(sock)
        sock.connect(address)
        return sock

    def connect_peers(self, addresses: dict[str, str]) -> None:
        """The group's topology: a push to every other model's inbox (once each)."""
        for name, address in addresses.items():
            if name != self.name and name not in self.to_peer:
                self.to_peer[name] = self.push(address)

    def send(self, sock: zmq.Socket, msg: Any) -> None:
        sock.send(encode(msg), zmq.NOBLOCK)

    def send_later(self, sock: zmq.Socket, msg: Any) -> None:
        """Send during the next step (or before the loop next waits), after what is already queued."""
        self.outbox.append((sock, msg))

    def flush(self) -> None:
        outbox, self.outbox = self.outbox, []
        for sock, msg in outbox:
            self.send(sock, msg)

    def receive_ready(self) -> None:
        """Receive and decode what has arrived, without waiting; handled later, in order."""
        self.received += receive_waiting(self.inbox, self.name)

    def take(self, timeout_ms: int) -> list[Any]:
        """The messages to handle now, in arrival order, waiting up to `timeout_ms` for one; before it
        waits, everything queued goes out (nothing may stay unsent meanwhile)."""
        if timeout_ms:
            self.flush()
        if not self.received and not self.inbox.poll(timeout_ms):
            return []
        self.receive_ready()
        received, self.received = self.received, []
        return received

    def close(self) -> None:
        self.flush()
        if self.entry_watch is not None:
            self.entry_watch.close()
        for sock in (self.inbox, self.to_entry, *self.to_peer.values()):
            sock.close(linger=500)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
