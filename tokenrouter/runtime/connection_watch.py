"""Watching a tcp connection to a process that is not our child (a joined subserver, or the entry seen
from one): no exit code to read, so the connection's life stands in for the process's. A process that
dies closes its sockets (the peer sees the disconnect at once); a host that dies stops answering
ZeroMQ's heartbeats, which closes the connection after HEARTBEAT_TIMEOUT_MS."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 10_000

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class HandshakeFailed(RuntimeError):
    """The peer listens but refused our handshake, or never answered."""


class ConnectionWatch:
    """Attach to a socket before connect(); then poll `gone()` or wait for the handshake."""

    def __init__(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                               | _HANDSHAKE_FAILED)
        self.connected = False
        self.lost = False
        self.failed = False

    def _read(self, timeout_ms: int) -> None:
        while self.monitor.poll(timeout_ms):
            timeout_ms = 0
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif event & _HANDSHAKE_FAILED:
                self.failed = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.lost = True

    def gone(self) -> bool:
        """True once a connection that had been made has dropped."""
        self._read(0)
        return self.lost

    def wait_handshake(self, timeout: float, what: str) -> None:
        """Return once the handshake succeeded; raise HandshakeFailed naming the likely cause."""
        deadline = time.monotonic() + timeout
        while not self.connected:
            if self.failed:
                raise HandshakeFailed(f"{what} refused the handshake: the shared secret differs from its own "
                                      "(or only one side has a secret)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandshakeFailed(f"no answer from {what} within {timeout:.0f} s: is it running, and is the "
                                      "address and port reachable from here?")
            self._read(int(min(left, 0.2) * 1000))

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
