"""The project's cache folder: built kernels, compiled graphs, the prepared default pair."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TOKENROUTER_CACHE, else ~/.cache/tokenrouter."""
    root = os.environ.get("TOKENROUTER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenrouter")
    return Path(root)
