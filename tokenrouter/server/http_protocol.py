"""uvicorn's HTTP/1.1 protocol with a time limit on reading a request's headers.

uvicorn times out idle keep-alive connections only: a client that opens a connection and sends part
of a request line or headers (slowloris) holds it, and a slot of the event loop's connection set,
forever. Here a connection that has not delivered complete headers within `header_timeout` seconds
of its first byte (or of opening) is closed. The body is the handlers' business (max body size,
request time limit).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout: float = 10.0  # set per server by with_header_timeout

    _header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[HeaderTimeoutProtocol]:
        if not seconds > 0:
            raise ValueError(f"header_timeout must be positive, got {seconds}")
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # part of a request's head (or a keep-alive connection's next one) arrived
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closing a connection that sent no complete request headers in %g s", self.header_timeout)
            self.transport.close()
