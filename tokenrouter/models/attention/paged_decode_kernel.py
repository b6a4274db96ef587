"""The CPU paged attention kernel for decodes and short extends (paged_decode.c), built on first use
with the machine's C compiler and called through ctypes.

Why it exists: PyTorch ships no paged attention for CPU, and the pure PyTorch decode path
(torch_backend.py) first gathers every key and value row into a padded copy, which on this
machine costs about four times a sequential read of the same bytes
(benchmarks/decode_attention_costs.py). The kernel reads each page once, in place.

Why plain C through ctypes rather than a torch C++ extension: the C file includes no torch headers,
so it builds in under a second where an extension takes about a minute on every new machine, and
ctypes releases the GIL for the call, as the engine's overlapped I/O thread needs.

The build: `-O3 -march=native -ffast-math -fopenmp-simd`, compiled and linked as two commands so
that gcc does not link crtfastmath.o, which would set flush-to-zero for the whole process;
-ffast-math only lets the exp loop use glibc's vector exp and the sums be reordered. Results
differ from the gather path's by float rounding (tests/test_attention_backend.py holds both to
1e-5 of the reference). The library is kept in the cache folder under a key of the source, the
compiler and this CPU's flags (-march=native builds for the CPU it runs on). Without a compiler,
or when the build fails, `load_kernel()` returns None, says why in the log once, and the backend
keeps its gather path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenrouter.cache_dir import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-std=c11")
_ERRORS = {-1: "more query heads than the kernel's 256, or heads not a multiple of KV heads",
           -2: "a query row with no key to attend", -3: "no memory for the scores"}


class PagedDecodeKernel:
    """Attention of single query rows over their requests' pages, on CPU, float32.

    `__call__` takes one entry per query row: the request's row of the page table, the row of q
    and out, and how many keys it attends (its position + 1). q and out are [T, H, D]; kc and vc
    one layer of the pool, [slots, Hkv, D]. Every tensor must be contiguous and on the CPU, the
    floats float32 and the indices int64; the caller (the attention backend's plan) ensures it
    once per step, not per layer.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_decode_f32
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, page_table: torch.Tensor,
                 reqs: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, page_size: int, scale: float,
                 out: torch.Tensor) -> None:
        _, h, d = q.shape
        rc = self._fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), page_table.data_ptr(), page_table.stride(0),
                      reqs.data_ptr(), rows.data_ptr(), lens.data_ptr(), reqs.numel(), h, kc.shape[1], d,
                      page_size, scale, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"paged decode kernel: {_ERRORS.get(rc, f'error {rc}')}")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        compile_cmd = [cc, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)]
        for cmd in (compile_cmd, [cc, "-shared", str(obj), "-o", str(lib), "-lm"]):
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if run.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {run.stderr.strip()[-2000:]}")
        os.replace(lib, target)  # atomic: processes building at once each leave a whole library


@functools.cache
def load_kernel() -> PagedDecodeKernel | None:
    """The kernel, built once per source, compiler and CPU; None (logged) where it cannot be built."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        logger.warning("no C compiler %r: CPU decode attention stays on the gather path (slower)", cc)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *COMPILE_FLAGS, _cpu_flags()]).encode())
        target = cache_dir() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
        if not target.exists():
            _build(cc, target)
        return PagedDecodeKernel(ctypes.CDLL(str(target)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("the CPU paged decode kernel could not be built (%s): decode attention stays on the "
                       "gather path (slower)", e)
        return None
