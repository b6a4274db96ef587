"""Start the server: the routed group's subservers, the entry thread, and uvicorn."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from tokenrouter.group_config import GroupConfig
from tokenrouter.server.app import ServerConfig, build_app
from tokenrouter.server.async_entry import AsyncEntry
from tokenrouter.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, killing the process before our
    own cleanup runs; here a signal ends serve() normally, so the subservers are stopped and the
    process exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def serve(group: GroupConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, grace_period: float = 30.0, log_level: str = "info",
          restart_on_failure: bool = False, max_body_bytes: int = 8 << 20,
          request_timeout: float | None = None) -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, let in-flight requests finish for up to
    `grace_period` seconds (the rest are aborted), stop every subserver and return."""
    runtime = AsyncEntry(group, restart_on_failure=restart_on_failure)
    runtime.start(timeout=group.startup_timeout + 10)
    try:
        assert runtime.entry is not None
        tokenizer = load_tokenizer(group.spec(runtime.entry.algorithm.entry_model).path)
        app = build_app(runtime, tokenizer, ServerConfig(model_name or group.name, api_key, max_body_bytes,
                                                        request_timeout))
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=grace_period, access_log=False)
        server = GracefulServer(config)
        logger.info("serving %s (%s) on http://%s:%d", model_name or group.name, ", ".join(group.names), host, port)
        server.run()
    finally:
        runtime.close()
