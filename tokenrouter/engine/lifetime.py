"""Child processes that must not outlive their parent."""

from __future__ import annotations

import ctypes
import signal
import sys


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (no orphans, even on SIGKILL of the parent)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
