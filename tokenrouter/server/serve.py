"""Start the server: the routed group's subservers, the entry thread, and uvicorn; with a PairUpgrade
(the embedded default before its routed pair is prepared), the pair's preparation once serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

import uvicorn

from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.server.app import ServerConfig, build_app
from tokenrouter.server.async_entry import AsyncEntry
from tokenrouter.server.http_protocol import HeaderTimeoutProtocol
from tokenrouter.server.pair_upgrade import ALONE, PairUpgrade
from tokenrouter.server.runtime_switch import Runtime, RuntimeSwitch

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, killing the process before our
    own cleanup runs; here a signal ends serve() normally, so the subservers are stopped and the
    process exits 0.

    At the end of the grace period uvicorn cancels the handlers still running, which cuts a stream
    off with no ending a client can recognise. So shortly before that (a second, or half the grace
    period when it is shorter) every request still in flight is ended here with an error (a stream's
    last events are an error event and [DONE]; a non-streaming request gets 503) and aborted on the
    subservers, and the connections close on their own within the grace period.

    `on_started` runs on the event loop once the server listens."""

    def __init__(self, config: uvicorn.Config, runtime: Runtime | None = None,
                 on_started: Callable[[asyncio.AbstractEventLoop], None] | None = None) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started(asyncio.get_running_loop())

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.config.timeout_graceful_shutdown
        ender = None
        if self.runtime is not None and grace is not None:
            ender = asyncio.create_task(self._end_in_flight(grace))
        try:
            await super().shutdown(sockets)
        finally:
            if ender is not None:
                ender.cancel()

    async def _end_in_flight(self, grace: float) -> None:
        await asyncio.sleep(max(0.0, grace - min(1.0, grace / 2)))
        assert self.runtime is not None
        n = self.runtime.abort_all(f"the server is shutting down: the request did not finish within the "
                                   f"{grace:g} s grace period")
        if n:
            logger.warning("aborted %d request(s) still running at the end of the %g s grace period", n, grace)


def serve(group: GroupConfig, server_cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          grace_period: float = 30.0, log_level: str = "info", restart_on_failure: bool = False,
          header_timeout: float = 10.0, upgrade: PairUpgrade | None = None) -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, let in-flight requests finish for up to
    `grace_period` seconds (the rest are aborted), stop every subserver and return. A connection that
    has not sent a request's complete headers within `header_timeout` seconds is closed. With
    `upgrade`, `group` is SmolLM2 alone, serving until the upgrade switches to the routed pair."""
    protocol = HeaderTimeoutProtocol.with_header_timeout(header_timeout)
    first = AsyncEntry(group, restart_on_failure=restart_on_failure)
    first.start(timeout=group.startup_timeout + 10)
    runtime = RuntimeSwitch(first, ALONE if upgrade else None)
    try:
        assert first.entry is not None
        tokenizer = load_tokenizer(group.spec(first.entry.algorithm.entry_model).engine.model_path)
        app = build_app(runtime, tokenizer, server_cfg, serving=upgrade.card if upgrade else None)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                                timeout_graceful_shutdown=grace_period, access_log=False)
        server = GracefulServer(config, runtime,
                                on_started=(lambda loop: upgrade.start(runtime, loop)) if upgrade else None)
        logger.info("serving %s (%s) on http://%s:%d", server_cfg.model_name, ", ".join(group.names), host, port)
        server.run()
    finally:
        if upgrade is not None:
            upgrade.close()
        runtime.close()
