"""The folded R2R router's forward in one C call (r2r_kernel.c): `RouterKernel(...)(hidden, tokens,
top_logits)` -> one logit per row, what routers.py FoldedR2R computes with torch calls, equal up to
float rounding (tests/test_algorithms.py).

Why: at a decode step's few rows the router's ~20 torch calls (six residual blocks of a layer norm,
two products and a GELU) cost far more in per-call overhead than in arithmetic; in a served pair's
small-model subserver the router was about 30% of a step's time (py-spy, 2-core Xeon, 2026-12-07).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from tokenrouter.models.native_build import load_library

SOURCE = Path(__file__).with_name("r2r_kernel.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-mprefer-vector-width=512",
                 "-std=c11")

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Block(ctypes.Structure):
    _fields_ = [("norm_w", _P), ("norm_b", _P), ("up", _P), ("up_b", _P), ("down", _P), ("down_b", _P), ("eps", _F)]


class _Router(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("top_k", _I64), ("width", _I64), ("blocks", _I64), ("vocab", _I64),
                ("token_rows", _P), ("hidden_map", _P), ("logit_map", _P), ("bias", _P), ("block", _P),
                ("norm_w", _P), ("norm_b", _P), ("out", _P), ("norm_eps", _F), ("out_bias", _F)]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as float32 with unit stride along its rows (any row stride: the kernel takes it)."""
    t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


class RouterKernel:
    """Holds the folded weights as float32 contiguous tensors (the given ones where already so; the C side
    keeps pointers into them). Maps are input-major:
    `hidden_map` [hidden, width], `logit_map` [top_k, width], each block's up [width, 4 width] and down
    [4 width, width]; `token_rows` [vocabulary, width]."""

    def __init__(self, lib: ctypes.CDLL, token_rows: torch.Tensor, hidden_map: torch.Tensor, logit_map: torch.Tensor,
                 bias: torch.Tensor, blocks: Sequence[tuple[torch.Tensor, torch.Tensor, float, torch.Tensor,
                                                            torch.Tensor, torch.Tensor, torch.Tensor]],
                 norm: tuple[torch.Tensor, torch.Tensor, float], out_map: torch.Tensor, out_bias: torch.Tensor) -> None:
        self._fn = lib.r2r_score
        self._fn.argtypes = [_P, _P, _I64, _P, _P, _I64, _I64, _P]
        self._fn.restype = ctypes.c_int
        kept = [_f32(token_rows), _f32(hidden_map), _f32(logit_map), _f32(bias), _f32(norm[0]), _f32(norm[1]),
                _f32(out_map).reshape(-1)]
        self._blocks = (_Block * len(blocks))()
        for slot, (norm_w, norm_b, eps, up, up_b, down, down_b) in zip(self._blocks, blocks):
            tensors = [_f32(t) for t in (norm_w, norm_b, up, up_b, down, down_b)]
            kept += tensors
            slot.norm_w, slot.norm_b, slot.up, slot.up_b, slot.down, slot.down_b = (t.data_ptr() for t in tensors)
            slot.eps = eps
        self._kept = kept  # the tensors the pointers point into
        rows, hidden, logits = kept[0], kept[1], kept[2]
        self._router = _Router(hidden.shape[0], logits.shape[0], rows.shape[1], len(blocks), rows.shape[0],
                               rows.data_ptr(), hidden.data_ptr(), logits.data_ptr(), kept[3].data_ptr(),
                               ctypes.addressof(self._blocks), kept[4].data_ptr(), kept[5].data_ptr(),
                               kept[6].data_ptr(), norm[2], float(out_bias.reshape(()).item()))

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor, top_logits: torch.Tensor) -> torch.Tensor:
        hidden, top_logits = _rows(hidden), _rows(top_logits)
        tokens = tokens.to(torch.int64).contiguous()
        rows = hidden.shape[0]
        assert hidden.shape[1] == self._router.hidden and top_logits.shape == (rows, self._router.top_k)
        assert tokens.shape == (rows,)
        out = torch.empty(rows, dtype=torch.float32)
        if rows == 0:  # malloc(0) may return NULL: no call
            return out
        rc = self._fn(ctypes.byref(self._router), hidden.data_ptr(), hidden.stride(0), tokens.data_ptr(),
                      top_logits.data_ptr(), top_logits.stride(0), rows, out.data_ptr())
        if rc == -2:
            raise ValueError(f"r2r router: a token id outside the vocabulary of {self._router.vocab}")
        if rc != 0:
            raise MemoryError("r2r router: no memory for the kernel's buffers")
        return out


@functools.cache
def load_library_once() -> ctypes.CDLL | None:
    """The kernel's library, built once per source, compiler and CPU; None (logged) where it cannot be built."""
    return load_library(SOURCE, COMPILE_FLAGS, "r2r router kernel", "the router runs as torch calls")
