"""Subservers the entry does not spawn itself: joined by hand from another host (runtime/subserver/joiner.py,
met by join_desk.py) or started as Ray actors (runtime/subserver/ray_actor.py, asked for by
ray_subserver.py). The entry sees them through RemoteSubserver, as it sees its own children through
multiprocessing.Process."""

from __future__ import annotations

from typing import Protocol


class RemoteSubserver(Protocol):
    def failure(self) -> str | None:
        """Why the subserver is gone, or None while it serves."""

    def wait(self, timeout: float) -> bool:
        """After Shutdown: wait until it has gone; True if it did."""

    def kill(self) -> None:
        """Stop it without asking (where that is possible from here)."""

    def close(self) -> None:
        """Free what the entry holds for it (before the entry's zmq context ends)."""
