"""The skinny GEMM (skinny_gemm.c): products of a few rows by a weight packed in panels of 16 output
columns, for float32 on CPU, built on first use (tokenrouter/models/native_build.py); and the three
products of the screened head (screened_head.py): approximate ones on bfloat16 pair panels
(`pack_pairs`), the columns a row must have exactly (`select`), and those columns (`gather`).

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


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [n, k] (converted to `dtype`) as panels [ceil(n / 16), k, 16]: panel p holds output
    columns 16p..16p+15, each input feature's 16 weights side by side (the last panel zero-padded)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=dtype)
    padded[:n] = weight.detach()
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] rounded to bfloat16 (to nearest even) as pair panels [ceil(n / 16), ceil(k / 2),
    16, 2]: panel p, pair i holds output columns 16p..16p+15, each with its weights for inputs 2i and
    2i + 1 side by side (zero-padded); `pack` of the pairs taken as one 32-bit feature each."""
    n, k = weight.shape
    even = torch.zeros(n, k + k % 2, dtype=torch.bfloat16)
    even[:, :k] = weight.detach()
    return pack(even.view(torch.int32), torch.int32).view(torch.bfloat16).view(-(-n // PANEL), -(-k // 2), PANEL, 2)


class SkinnyGemm:
    """`__call__(x, panels, n, bias, out=None)`: x [rows, k] (float32, CPU, unit stride along k) times
    the weight packed by `pack` (n output columns), plus bias [n] or None, into `out` ([rows, n] rows
    of unit stride, e.g. a block of a larger output) or a new tensor. The screened head's products:
    `screen`, `select`, `gather` (below)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.skinny_gemm_f32
        self._fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64]
        self._fn.restype = ctypes.c_int
        self._screen = lib.skinny_screen_bf16
        self._screen.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64]
        self._screen.restype = ctypes.c_int
        self._select = lib.skinny_select
        self._select.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_double, ptr]
        self._select.restype = i64
        self._gather = lib.skinny_gather_f32
        self._gather.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr, i64]
        self._gather.restype = ctypes.c_int
        self._top_ranked = lib.skinny_top_ranked
        self._top_ranked.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ctypes.c_double, i64,
                                     ptr, ptr, ptr]
        self._top_ranked.restype = ctypes.c_int

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

    def screen(self, x: torch.Tensor, pairs: torch.Tensor, n: int) -> torch.Tensor:
        """x [rows, k] (float32, rounded to bfloat16 inside) times the weight packed by `pack_pairs`
        (n columns), [rows, n]: each element an ordered float32 sum of exact bfloat16 products."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        if pairs.dtype != torch.bfloat16 or pairs.shape[1] != -(-k // 2) or pairs.shape[0] * PANEL < n:
            raise ValueError(f"skinny screen: x has {k} features; pair panels {tuple(pairs.shape)} do not match")
        y = torch.empty(rows, n, dtype=torch.float32)
        rc = self._screen(x.data_ptr(), rows, x.stride(0), pairs.data_ptr(), n, k, y.data_ptr(), n)
        if rc == -2:
            raise MemoryError("skinny screen: no memory for the rounded rows")
        if rc != 0:
            raise RuntimeError(f"skinny screen: shape ({rows}, {k}) x ({n}, {k}) not taken")
        return y

    def select(self, approx: torch.Tensor, top: int, scale: torch.Tensor, norms: torch.Tensor,
               offset: float = 0.0) -> torch.Tensor | None:
        """approx [rows, n] within scale[r] * norms[j] + offset (float64) of the exact products: the columns,
        ascending, that can hold one of some row's `top` largest exact products; None when a row is
        not finite."""
        rows, n = approx.shape
        if (approx.stride(1) != 1 or scale.dtype != torch.float64 or scale.shape != (rows,)
                or norms.dtype != torch.float64 or norms.shape != (n,) or not 1 <= top <= n):
            raise ValueError(f"skinny select: approx {tuple(approx.shape)}, top {top}, scale {tuple(scale.shape)}, "
                             f"norms {tuple(norms.shape)}")
        scale, norms = scale.contiguous(), norms.contiguous()
        cols = torch.empty(n, dtype=torch.int64)
        count = self._select(approx.data_ptr(), rows, n, approx.stride(0), top, scale.data_ptr(), norms.data_ptr(),
                             offset, cols.data_ptr())
        if count == -2:
            raise MemoryError("skinny select: no memory for the marks")
        return None if count < 0 else cols[:count]

    def gather(self, x: torch.Tensor, weight: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """x [rows, k] times the rows `columns` (int64) of the float32 weight [n, k] (unit stride along
        k), [rows, len(columns)]: each value bit-identical to that column of `__call__` on `pack(weight)`."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        if weight.dtype != torch.float32 or weight.shape[1] != k or weight.stride(1) != 1:
            raise ValueError(f"skinny gather: the weight must be float32 [n, {k}] with unit stride, got "
                             f"{weight.dtype} {tuple(weight.shape)}")
        columns = columns.to(torch.int64).contiguous()
        count = len(columns)
        y = torch.empty(rows, count, dtype=torch.float32)
        rc = self._gather(x.data_ptr(), rows, x.stride(0), weight.data_ptr(), weight.shape[0], k, weight.stride(0),
                          columns.data_ptr(), count, y.data_ptr(), max(count, 1))
        if rc == -2:
            raise MemoryError("skinny gather: no memory for a panel")
        if rc != 0:
            raise ValueError(f"skinny gather: a column index outside [0, {weight.shape[0]})")
        return y

    def top_ranked(self, x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor, top: int, scale: torch.Tensor,
                   norms: torch.Tensor, offset: float, max_columns: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """x [rows, k] with its screen `approx` [rows, n] (within scale[r] * norms[j] + offset, float64, of
        the exact products of the float32 weight [n, k]): (argmax [rows], the exact products of each
        row's `top` columns approx ranks highest [rows, top] descending, their columns [rows, top]),
        the argmax exact; the products as `gather`'s. None when a row is not finite or more than
        `max_columns` columns would be recomputed."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, k = x.shape
        n = weight.shape[0]
        if (weight.dtype != torch.float32 or weight.shape[1] != k or weight.stride(1) != 1 or approx.shape != (rows, n)
                or approx.stride(1) != 1 or scale.dtype != torch.float64 or norms.dtype != torch.float64
                or not 1 <= top <= n):
            raise ValueError(f"skinny top_ranked: x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}, "
                             f"approx {tuple(approx.shape)}, top {top}")
        scale, norms = scale.contiguous(), norms.contiguous()
        argmax, ids = torch.empty(rows, dtype=torch.int64), torch.empty(rows, top, dtype=torch.int64)
        values = torch.empty(rows, top, dtype=torch.float32)
        rc = self._top_ranked(x.data_ptr(), rows, x.stride(0), weight.data_ptr(), n, k, weight.stride(0),
                              approx.data_ptr(), approx.stride(0), top, scale.data_ptr(), norms.data_ptr(), offset,
                              max_columns, argmax.data_ptr(), values.data_ptr(), ids.data_ptr())
        if rc == -2:
            raise MemoryError("skinny top_ranked: no memory for its buffers")
        return None if rc != 0 else (argmax, values, ids)


@functools.cache
def load_kernel() -> SkinnyGemm | None:
    """The kernel, built once per source, compiler and CPU; None (logged) where it cannot be built."""
    lib = load_library(SOURCE, COMPILE_FLAGS, "skinny GEMM", "linear layers stay on oneDNN at every row count")
    return None if lib is None else SkinnyGemm(lib)
