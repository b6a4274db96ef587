"""Builds the engine's C kernels (paged attention, the skinny GEMM) into shared libraries on first use,
with the machine's C compiler, and loads them through ctypes.

Why plain C through ctypes rather than a torch C++ extension: the C files include no torch headers,
so each builds in under a second where an extension takes about a minute on every new machine, and
ctypes releases the GIL for the call, as the engine's overlapped I/O thread needs.

Each source is compiled and linked as two commands, so that gcc never links crtfastmath.o (which
-ffast-math would pull in, setting flush-to-zero for the whole process). A library is kept in the
cache folder under a key of its source, the compiler, its flags and this CPU's flags (-march=native
builds for the CPU it runs on); processes building at once each leave a whole library. Without a
compiler, or when a build fails, `load_library` returns None and says why in the log once, with
what the engine does instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tokenrouter.cache_dir import cache_dir

logger = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _build(cc: str, source: Path, flags: Sequence[str], link_flags: Sequence[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        compile_cmd = [cc, *flags, "-c", str(source), "-o", str(obj)]
        for cmd in (compile_cmd, [cc, "-shared", str(obj), "-o", str(lib), *link_flags, "-lm"]):
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if run.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {run.stderr.strip()[-2000:]}")
        os.replace(lib, target)


def load_library(source: Path, flags: Sequence[str], what: str, instead: str,
                 link_flags: Sequence[str] = ()) -> ctypes.CDLL | None:
    """`source` built with `flags` (plus -fPIC) and linked with `link_flags`, and loaded; None where it
    cannot be built, logged as "the CPU <what> ...: <instead>" (what the caller falls back to)."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        logger.warning("no C compiler %r for the CPU %s: %s", cc, what, instead)
        return None
    flags = (*flags, "-fPIC")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source.read_text(), cc, version, *flags, *link_flags, _cpu_flags()]).encode())
        target = cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
        if not target.exists():
            _build(cc, source, flags, link_flags, target)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("the CPU %s could not be built (%s): %s", what, e, instead)
        return None
