"""The CPU paged attention kernel for decodes and short extends (paged_decode.c), built on first use
(tokenrouter/models/native_build.py) and called through ctypes.

Why it exists: PyTorch ships no paged attention for CPU, and the pure PyTorch decode path
(torch_backend.py) first gathers every key and value row into a padded copy, which on this
machine costs about four times a sequential read of the same bytes
(benchmarks/decode_attention_costs.py). The kernel reads each page once, in place.

Built with -ffast-math, which only lets the exp loop use glibc's vector exp and the sums be
reordered (native_build links without it, so the process keeps its float mode). Results differ from
the gather path's by float rounding (tests/test_attention_backend.py holds both to 1e-5 of the
reference). Without a compiler, or when the build fails, `load_kernel()` returns None and the
backend keeps its gather path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tokenrouter.models.native_build import load_library

SOURCE = Path(__file__).with_name("paged_decode.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c11")
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
        self.address: int = ctypes.cast(fn, ctypes.c_void_p).value  # for C callers (models/layer_loop.c)

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, page_table: torch.Tensor,
                 reqs: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, page_size: int, scale: float,
                 out: torch.Tensor) -> None:
        _, h, d = q.shape
        rc = self._fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), page_table.data_ptr(), page_table.stride(0),
                      reqs.data_ptr(), rows.data_ptr(), lens.data_ptr(), reqs.numel(), h, kc.shape[1], d,
                      page_size, scale, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"paged decode kernel: {_ERRORS.get(rc, f'error {rc}')}")


@functools.cache
def load_kernel() -> PagedDecodeKernel | None:
    """The kernel, built once per source, compiler and CPU; None (logged) where it cannot be built."""
    lib = load_library(SOURCE, COMPILE_FLAGS, "paged decode kernel",
                       "decode attention stays on the gather path (slower)")
    return None if lib is None else PagedDecodeKernel(lib)
