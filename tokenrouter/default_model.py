"""The embedded default model: built deterministically into a cache folder on first use.

Until the trained small/large pair exists, this is a random-weight Llama: it exercises the whole
engine, but its text is meaningless, and the CLI says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "default-random-llama-v2"
RANDOM_WEIGHTS_WARNING = (
    "note: no --model-path given; using the embedded default model, which has RANDOM weights "
    "(its output is meaningless text)"
)


def cache_dir() -> Path:
    root = os.environ.get("TOKENROUTER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenrouter")
    return Path(root)


def ensure_default_model() -> Path:
    """The default model's folder, built once (atomically) and reused."""
    from tokenrouter.random_model import build_random_model

    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build_random_model(tmp, arch="llama", preset="small", seed=0)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to a concurrent builder: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
