"""The skinny GEMM (skinny_gemm.c): products of a few rows by a weight packed in panels of 16 output
columns, for float32 on CPU, built on first use (tokenrouter/models/native_build.py).

Why it exists: at the row counts of decoding, a product is bound by streaming the weight from memory,
and oneDNN's kernels stream it at about 11-12 GB/s on this machine where one core reads memory at
about 22 (benchmarks/skinny_gemm_costs.py). The skinny kernel reads each weight once for every row
of a tile and keeps the sums in registers, near the read rate up to a few rows; past a few dozen rows
oneDNN's blocking wins, so the packed linears (packed_linear.py) send only up to `MAX_ROWS` rows here.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tokenrouter.models.native_build import load_library

SOURCE = Path(__file__).with_name("skinny_gemm.c")
# No -ffast-math: each sum keeps its order (a row's results do not depend on its batch).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=gnu11")
PANEL = 16


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] as panels [ceil(n / 16), k, 16]: panel p holds output columns 16p..16p+15, each
    input feature's 16 weights side by side (the last panel zero-padded)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


class SkinnyGemm:
    """`__call__(x, panels, n, bias, out=None)`: x [rows, k] (float32, CPU, unit stride along k) times
    the weight packed by `pack` (n output columns), plus bias [n] or None, into `out` ([rows, n] rows
    of unit stride, e.g. a block of a larger output) or a new tensor."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.skinny_gemm_f32
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        if panels.shape[1] != k:
            raise ValueError(f"skinny GEMM: x has {k} features, the weight {panels.shape[1]}")
        y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
        if y.shape != (rows, n) or y.stride(1) != 1:
            raise ValueError(f"skinny GEMM: out must be ({rows}, {n}) with unit stride, got {tuple(y.shape)}")
        rc = self._fn(x.data_ptr(), rows, x.stride(0), panels.data_ptr(), n, k,
                      None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0))
        if rc != 0:
            raise RuntimeError(f"skinny GEMM: shape ({rows}, {k}) x ({n}, {k}) not taken")
        return y


@functools.cache
def load_kernel() -> SkinnyGemm | None:
    """The kernel, built once per source, compiler and CPU; None (logged) where it cannot be built."""
    lib = load_library(SOURCE, COMPILE_FLAGS, "skinny GEMM", "linear layers stay on oneDNN at every row count")
    return None if lib is None else SkinnyGemm(lib)
