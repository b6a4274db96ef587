"""The embedded default's routed pair, prepared while SmolLM2 serves alone, then switched to.

`tokenrouter serve` with no model, before the default pair is prepared (cli.py), serves SmolLM2 alone
at once and hands this a command that prepares the pair. The preparation runs in a child process of
its own, so its CPU use (at a lower priority) and a crash stay apart from serving; it reports each
stage with the preparation's ETA, its notes, and at the end the pair's group config or why it failed,
one JSON line each on its stdout (training/background_prepare.py writes them with `event_line`). When
the pair is prepared its group starts beside SmolLM2's and the RuntimeSwitch sends new requests to it;
SmolLM2's group finishes the requests it took, then stops. A preparation, a config or a start that
fails leaves SmolLM2 serving; the log and `/v1/models` (`serving`, shown on the routing page) say why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.server.async_entry import AsyncEntry
from tokenrouter.server.runtime_switch import Drained, RuntimeSwitch

logger = logging.getLogger(__name__)

ALONE = "smollm2-alone"  # routing.serving while SmolLM2 serves alone
PAIR = "pair"  # routing.serving once the pair serves
STOP_WAIT_S = 10.0  # a preparation asked to stop (SIGTERM) is killed after this


class StageEvent(msgspec.Struct, tag="stage"):
    """A stage starting (`seconds` None) or done (`seconds`: its time), as training/prepare.py's
    StageReport gives it, with the line its log shows."""

    number: int
    total: int
    name: str
    seconds: float | None
    elapsed: float
    eta: float  # seconds the preparation has left, estimated when this was sent
    line: str


class NoteEvent(msgspec.Struct, tag="note"):
    text: str


class ReadyEvent(msgspec.Struct, tag="ready"):
    config: str  # the prepared pair's group config (pair.yaml)


class FailedEvent(msgspec.Struct, tag="failed"):
    reason: str


PreparationEvent = Union[StageEvent, NoteEvent, ReadyEvent, FailedEvent]
_decoder = msgspec.json.Decoder(PreparationEvent)


def event_line(event: PreparationEvent) -> str:
    return msgspec.json.encode(event).decode()


def read_event(line: str) -> PreparationEvent | None:
    """The event on one line of the preparation's stdout; None for a line that is not one (something
    a library printed)."""
    try:
        return _decoder.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class PairFailed(Exception):
    """The pair will not serve; the message says why."""


@dataclass
class PairStatus:
    """Where the pair is, for the log and the model card. state: preparing -> starting -> serving, or
    failed (from any of the first two)."""

    started: float  # time.monotonic() when the preparation started
    state: str = "preparing"
    stage: StageEvent | None = None
    stage_at: float = 0.0  # time.monotonic() when `stage` arrived
    prepared_s: float | None = None  # seconds the preparation took
    reason: str | None = None
    in_flight_at_switch: int | None = None
    drained: Drained | None = None

    def card(self, now: float) -> dict[str, Any]:
        st = self.stage
        return {
            "state": self.state, "elapsed_s": round(now - self.started, 1), "prepared_s": self.prepared_s,
            "stage": st.name if st else None, "stage_number": st.number if st else None,
            "stages": st.total if st else None,
            # counted down from the last report; 0 while the last stage runs over its estimate
            "eta_s": round(max(0.0, st.eta - (now - self.stage_at)), 1) if st and self.state == "preparing" else None,
            "reason": self.reason, "in_flight_at_switch": self.in_flight_at_switch,
            "drained": None if self.drained is None else {"requests": self.drained.requests,
                                                          "pages_held": self.drained.pages_held},
        }


def stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the process group `proc` leads, SIGKILL after STOP_WAIT_S; waits for `proc`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"


class PairUpgrade:
    """`command` prepares the pair (training/background_prepare.py); `load` turns the pair's config
    path into the group to serve (the serve flags applied)."""

    def __init__(self, command: list[str], load: Callable[[str], GroupConfig],
                 restart_on_failure: bool = False) -> None:
        self.command, self.load, self.restart_on_failure = command, load, restart_on_failure
        self.status = PairStatus(time.monotonic())
        self._lock = threading.Lock()
        self._closed = False
        self._proc: subprocess.Popen[str] | None = None
        self._pending: AsyncEntry | None = None  # the pair's group, started, not yet handed to the switch
        self._thread: threading.Thread | None = None

    def start(self, switch: RuntimeSwitch, loop: asyncio.AbstractEventLoop) -> None:
        """Prepare, start and switch to the pair in a thread of its own. The preparation process dies
        with that thread (engine/lifetime.py), which outlives it."""
        self.status.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(switch, loop), name="tokenrouter-pair", daemon=True)
        self._thread.start()

    def card(self) -> dict[str, Any]:
        """The model card's `serving`: what serves now (routing.serving's value) and the pair's status."""
        with self._lock:
            return {"group": PAIR if self.status.state == "serving" else ALONE,
                    "pair": self.status.card(time.monotonic())}

    def close(self) -> None:
        """Stop the preparation, or a pair started and not handed over yet."""
        with self._lock:
            self._closed = True
            proc, pending = self._proc, self._pending
        if proc is not None and proc.poll() is None:
            stop_group(proc)
        if pending is not None:
            pending.close()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)

    # ---- the thread --------------------------------------------------------------------------
    def _run(self, switch: RuntimeSwitch, loop: asyncio.AbstractEventLoop) -> None:
        try:
            config = self._prepare()
            if config is not None:
                self._start(config, switch, loop)
        except PairFailed as e:
            self._fail(str(e))
        except Exception as e:  # noqa: BLE001 - a bug here must not end serving: SmolLM2 goes on
            logger.exception("the routed pair's upgrade failed")
            self._fail(f"internal error: {type(e).__name__}: {e}")

    def _prepare(self) -> str | None:
        """Run the preparation to its end: the pair's config, or None when closed meanwhile."""
        # The child's stderr is the server's log: no progress bars there. In a session of its own it
        # and the processes it starts (answer workers, the operating point's group) stop together, and
        # a terminal's Ctrl-C reaches the server only, which decides.
        env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        with self._lock:
            self._proc = proc
            closed = self._closed
        if closed:
            stop_group(proc)
        logger.info("SmolLM2 serves alone while the routed pair is prepared in the background (process %d)", proc.pid)
        config = reason = None
        assert proc.stdout is not None
        for line in proc.stdout:
            event = read_event(line)
            if isinstance(event, StageEvent):
                with self._lock:
                    self.status.stage, self.status.stage_at = event, time.monotonic()
                logger.info("routed pair: %s", event.line)
            elif isinstance(event, NoteEvent):
                logger.info("routed pair: %s", event.text)
            elif isinstance(event, ReadyEvent):
                config = event.config
            elif isinstance(event, FailedEvent):
                reason = event.reason
            else:
                logger.info("routed pair: %s", line.rstrip())
        returncode = proc.wait()
        if self._closed:
            return None
        if config is not None and returncode == 0:
            return config
        raise PairFailed(reason or f"the preparation process ended with {exit_text(returncode)} without saying "
                                   "why (its output is in the server's log)")

    def _start(self, config: str, switch: RuntimeSwitch, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self.status.state = "starting"
            self.status.prepared_s = round(time.monotonic() - self.status.started, 1)
        logger.info("routed pair prepared in %.0f s; starting it (%s)", self.status.prepared_s, config)
        try:
            group = self.load(config)
        except (ValueError, OSError) as e:
            raise PairFailed(f"the prepared pair's config {config} cannot be served: {e}") from None
        runtime = AsyncEntry(group, restart_on_failure=self.restart_on_failure)
        try:
            runtime.start(timeout=group.startup_timeout + 10)
        except Exception as e:
            runtime.close()
            raise PairFailed(f"the routed pair did not start: {e}") from None
        assert runtime.entry is not None and switch.entry is not None
        if runtime.entry.vocab_hash != switch.entry.vocab_hash:
            runtime.close()
            raise PairFailed("the routed pair's vocabulary is not SmolLM2's, whose tokenizer the server uses")
        with self._lock:
            handed = not self._closed
            if handed:
                self._pending = runtime
                try:
                    loop.call_soon_threadsafe(self._switch, switch, runtime)
                except RuntimeError:  # the loop has stopped: the server is shutting down
                    self._pending, handed = None, False
        if not handed:
            runtime.close()

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            self.status.state, self.status.reason = "failed", reason
        logger.error("the routed pair will not serve: %s. SmolLM2 goes on serving alone", reason)

    # ---- on the event loop -------------------------------------------------------------------
    def _switch(self, switch: RuntimeSwitch, runtime: AsyncEntry) -> None:
        with self._lock:
            self._pending = None
            closed = self._closed or switch.closed
            if not closed:
                running = switch.switch_to(runtime, PAIR, self._drained)
                self.status.state, self.status.in_flight_at_switch = "serving", running
        if closed:  # the server is shutting down
            runtime.close()
            return
        logger.info("switched to the routed pair: new requests go to it; the %d request(s) running on SmolLM2 "
                    "finish there", running)

    def _drained(self, drained: Drained) -> None:
        with self._lock:
            self.status.drained = drained
        if drained.pages_held:
            logger.warning("SmolLM2's group stopped with %d KV pages held after its last request ended",
                           drained.pages_held)
        logger.info("SmolLM2's group finished its %d request(s) (KV pages held: %s) and stopped", drained.requests,
                    drained.pages_held)
