"""The group the HTTP handlers serve, replaceable while serving.

`RuntimeSwitch` stands where an AsyncEntry would: every request goes to the current group. After
`switch_to`, new requests go to the new group while the old one keeps running until the requests it
took have ended (finished, failed or aborted: each gets its Done from the group that ran it), then it
is asked for its KV pages (none should be held) and shut down. The handlers admit and submit a
request back to back on the event loop, and the switch runs on the loop too, so one group both
admits and runs every request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenrouter.runtime.entry.admission import AdmittedPlan
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Stats
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.server.async_entry import AsyncEntry, RequestStream

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1  # how often a replaced group is checked for requests still running


@dataclass(frozen=True)
class Drained:
    """A replaced group at its shutdown: the requests that were running on it at the switch (each
    finished there) and the KV pages its models still held once they had (0: none leaked)."""

    requests: int
    pages_held: int | None  # None: the group could not be asked (it had failed)


class RuntimeSwitch:
    """Serves through `current`, tagging each request's stream with the current `label` (what the
    response's `routing.serving` says; None: nothing)."""

    def __init__(self, runtime: AsyncEntry, label: str | None = None) -> None:
        self.current, self.label = runtime, label
        self._draining: list[AsyncEntry] = []
        self._drains: set[asyncio.Task[None]] = set()
        self.closed = False

    # ---- the AsyncEntry face, on the current group -----------------------------------------------
    @property
    def group(self) -> GroupConfig:
        return self.current.group

    @property
    def entry(self) -> Entry | None:
        return self.current.entry

    @property
    def healthy(self) -> bool:
        return self.current.healthy

    def admit(self, prompt_ids: list[int], params: SamplingParams,
              routing: dict[str, Any] | None = None) -> AdmittedPlan:
        return self.current.admit(prompt_ids, params, routing)

    def submit(self, plan: AdmittedPlan) -> RequestStream:
        stream = self.current.submit(plan)
        stream.serving = self.label
        return stream

    def abort(self, rid: str) -> None:
        # A request lives on one group; the others do not know its rid and ignore the abort.
        for runtime in self.runtimes():
            runtime.abort(rid)

    def abort_all(self, message: str) -> int:
        return sum(runtime.abort_all(message) for runtime in self.runtimes())

    async def stats(self) -> dict[str, Stats]:
        return await self.current.stats()

    def queue_lengths(self) -> tuple[int, int]:
        waiting, running = zip(*(runtime.queue_lengths() for runtime in self.runtimes()))
        return sum(waiting), sum(running)

    def runtimes(self) -> list[AsyncEntry]:
        """The current group, then those still finishing their requests."""
        return [self.current, *self._draining]

    def close(self) -> None:
        self.closed = True
        for task in self._drains:
            task.cancel()
        for runtime in self.runtimes():
            runtime.close()

    # ---- the switch --------------------------------------------------------------------------
    def switch_to(self, runtime: AsyncEntry, label: str | None, on_drained: Callable[[Drained], None]) -> int:
        """From now on every new request goes to `runtime` (started) with `label`; the old group
        finishes what it has and is shut down, then `on_drained` hears how that went. Runs on the
        event loop; returns the requests the old group still has."""
        old = self.current
        self.current, self.label = runtime, label
        self._draining.append(old)
        running = old.in_flight
        task = asyncio.get_running_loop().create_task(self._drain(old, running, on_drained))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return running

    async def _drain(self, old: AsyncEntry, running: int, on_drained: Callable[[Drained], None]) -> None:
        while old.in_flight:
            await asyncio.sleep(DRAIN_POLL_S)
        pages_held = None
        if old.healthy:
            try:
                stats = await old.stats()
                pages_held = sum(s.total_pages - s.free_pages - s.cached_pages for s in stats.values())
            except Exception:  # noqa: BLE001 - the group stops all the same; only the count is missing
                logger.exception("a replaced group did not give its stats")
        await asyncio.to_thread(old.close)
        self._draining.remove(old)
        on_drained(Drained(running, pages_held))


Runtime = AsyncEntry | RuntimeSwitch  # what the HTTP handlers serve through
