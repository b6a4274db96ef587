"""Runs the Entry in its own thread and hands its events to asyncio.

The Entry owns zmq sockets, which must stay in one thread; HTTP handlers live on the event loop.
Handlers enqueue commands (add, abort, stats) and wake the entry thread with a message on its own
inbox; the thread delivers each request's events to that request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from tokenrouter.runtime.entry.admission import AdmittedPlan
from tokenrouter.runtime.entry.entry import Entry, SubserverDied
from tokenrouter.runtime.entry.reassembly import Done, TokenOut
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Stats, Wake, encode
from tokenrouter.runtime.transport_security import secure_client
from tokenrouter.sampling_params import SamplingParams

__all__ = ["AsyncEntry", "Done", "EntryUnavailable", "RequestStream", "TokenOut"]

logger = logging.getLogger(__name__)


@dataclass
class RequestStream:
    """One request as the event loop sees it: its events arrive on `events`."""

    rid: str
    prompt_len: int
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    serving: str | None = None  # what served it, when the server says (runtime_switch.py): routing.serving


class EntryUnavailable(RuntimeError):
    """The group is not serving (starting, stopped, or a subserver died)."""


class AsyncEntry:
    def __init__(self, group: GroupConfig, restart_on_failure: bool = False) -> None:
        self.group = group
        self.restart_on_failure = restart_on_failure
        self.restarts = 0
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tokenrouter-entry", daemon=True)
        # Wake sockets live in a context of their own: the entry's context.term() waits for every
        # socket of its context, and these belong to other threads.
        self._wake_ctx = zmq.Context()
        self._wake_local = threading.local()
        self.entry: Entry | None = None
        self.info: dict[str, Any] = {}

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> None:
        """Start the entry thread and its subservers; raise if they fail to come up."""
        self._thread.start()
        self._ready.wait(timeout)
        if self._error is not None:
            raise self._error
        if not self._ready.is_set():
            raise EntryUnavailable("the routed group did not start in time")

    @property
    def healthy(self) -> bool:
        return self._ready.is_set() and self._error is None and not self._stop.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def in_flight(self) -> int:
        """Requests submitted whose Done has not been handed to the event loop yet."""
        return len(self._streams)

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(15.0)
        self._wake_ctx.destroy(linger=0)

    # ---- commands from the event loop --------------------------------------------------------
    def admit(self, prompt_ids: list[int], params: SamplingParams,
              routing: dict[str, Any] | None = None) -> AdmittedPlan:
        """Check a request once, by OpenAI's rules, against the group's limits (which are constants,
        so this runs on the event loop); a bad one raises ValueError (handlers answer 400)."""
        entry = self.entry
        if entry is None:
            raise EntryUnavailable(str(self._error) if self._error else "the routed group is not serving")
        return entry.rules.plan_openai(prompt_ids, params, routing)

    def submit(self, plan: AdmittedPlan) -> RequestStream:
        """Queue an admitted request. Its events (TokenOut, then one Done) arrive on the stream's queue."""
        if not self.healthy:
            raise EntryUnavailable(str(self._error) if self._error else "the routed group is not serving")
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = RequestStream(rid, len(plan.prompt_ids))
        self._streams[rid] = (stream, asyncio.get_running_loop())
        self._commands.put(("add", rid, plan))
        self._wake()
        return stream

    def abort(self, rid: str) -> None:
        if self._streams.pop(rid, None) is not None:
            self._commands.put(("abort", rid))
            self._wake()

    def abort_all(self, message: str) -> int:
        """End every request in flight with an error (503: its stream gets an error event, then
        [DONE]) and abort it on the subservers; how many there were. For the end of a shutdown's
        grace period."""
        rids = list(self._streams)
        for rid in rids:
            self._post(rid, Done(rid, "error", None, "", message, {}, 0, fatal=True))
            self.abort(rid)
        return len(rids)

    async def stats(self) -> dict[str, Stats]:
        fut: asyncio.Future[dict[str, Stats]] = asyncio.get_running_loop().create_future()
        self._commands.put(("stats", fut, asyncio.get_running_loop()))
        self._wake()
        return await asyncio.wait_for(fut, 10.0)

    def queue_lengths(self) -> tuple[int, int]:
        """(requests waiting for admission, requests admitted and unfinished) — approximate."""
        e = self.entry
        if e is None:
            return 0, 0
        waiting = len(e.queue)
        return waiting, len(e.reqs) - waiting

    def _wake(self) -> None:
        if self.entry is None:
            return
        sock = getattr(self._wake_local, "sock", None)
        address = self.entry.entry_address
        if sock is None or getattr(self._wake_local, "address", None) != address:  # new after a restart
            if self._wake_ctx.closed:
                return
            if sock is not None:
                sock.close(linger=0)
            sock = self._wake_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self.entry.keys)
            sock.connect(address)
            self._wake_local.sock, self._wake_local.address = sock, address
        try:
            sock.send(encode(Wake()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # ---- the entry thread --------------------------------------------------------------------
    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                entry = Entry(self.group, detokenize=True)
            except BaseException as e:  # noqa: BLE001 - reported to start(), or retried
                self._error = e
                if first or not self.restart_on_failure:
                    self._ready.set()
                    return
                logger.error("restarting the group failed (%s); trying again in 5 s", e)
                self._stop.wait(5.0)
                continue
            self.entry, self.info, self._error = entry, dict(entry.info), None
            self._ready.set()
            first = False
            try:
                while not self._stop.is_set():
                    self._run_commands(entry)
                    for ev in entry.poll(0.5):
                        try:
                            self._deliver(ev)
                        except Exception:  # noqa: BLE001 - one event's failure must not stop the thread
                            logger.exception("entry thread: delivering an event of %s failed", ev.req.rid)
                            self._fail(entry, ev.req.rid, "internal error while delivering the output")
            except SubserverDied as e:
                logger.error("%s", e)
                self._error = e
                self._fail_all(f"the model group failed: {e}")
            except BaseException as e:  # noqa: BLE001
                logger.exception("entry thread failed")
                self._error = e
                self._fail_all(f"internal error: {e}")
            finally:
                entry.close()
            if not self.restart_on_failure:
                return
            self.restarts += 1
            logger.warning("restarting the model group (restart %d)", self.restarts)

    def _run_commands(self, entry: Entry) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._run_command(entry, cmd)
            except SubserverDied:
                raise
            except Exception as e:  # noqa: BLE001 - one command's failure must not stop the thread
                logger.exception("entry thread: the %r command failed", cmd[0])
                if cmd[0] == "add":
                    self._fail(entry, cmd[1], f"the request could not be started: {type(e).__name__}")

    def _run_command(self, entry: Entry, cmd: tuple[Any, ...]) -> None:
        if cmd[0] == "add":
            _, rid, plan = cmd
            if rid not in self._streams:
                return  # aborted before it was added
            try:
                entry.enqueue(plan, rid=rid)
            except ValueError as e:
                self._post(rid, Done(rid, "error", None, "", str(e), {}, 0))
                self._streams.pop(rid, None)
        elif cmd[0] == "abort":
            entry.abort(cmd[1])
        elif cmd[0] == "stats":
            _, fut, loop = cmd
            try:
                result = entry.stats()
                loop.call_soon_threadsafe(_resolve, fut, result, None)
            except BaseException as e:  # noqa: BLE001
                loop.call_soon_threadsafe(_resolve, fut, None, e)

    def _fail(self, entry: Entry, rid: str, message: str) -> None:
        """End one request with an error, wherever it got to (queued, admitted, or not yet added)."""
        try:
            entry.fail(rid, message)
        except SubserverDied:
            raise
        except Exception:  # noqa: BLE001 - the request's stream still gets its error below
            logger.exception("entry thread: ending request %s failed", rid)
        self._post(rid, Done(rid, "error", None, "", message, {}, 0))
        self._streams.pop(rid, None)

    def _deliver(self, ev: TokenOut | Done) -> None:
        self._post(ev.rid, ev)
        if isinstance(ev, Done):
            self._streams.pop(ev.rid, None)

    def _post(self, rid: str, item: Any) -> None:
        entry = self._streams.get(rid)
        if entry is None:
            return
        stream, loop = entry
        try:
            loop.call_soon_threadsafe(stream.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening
            self._streams.pop(rid, None)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            self._post(rid, Done(rid, "error", None, "", message, {}, 0, fatal=True))
        self._streams.clear()


def _resolve(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
