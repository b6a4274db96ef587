"""A decoder's layers over a few rows in one C call (layer_loop.c), where every layer's four products
are GGUF blocks on block_gemm and the step's attention runs on the paged kernel: what
`DecoderLayer.fused_forward` does layer by layer in Python, with the same functions in the same order
(bit-identical: tests/test_layer_loop.py).

Why: at one row SmolLM2's 30 layers spent about half their time between the products: each of a
layer's dozen calls (the fused ops, the kernels, a conversion, an add, the K/V writes) costs 10-20 us of
Python, ctypes and tensor allocation for a few microseconds of work (the step's breakdown: 5.1 of 11.0
ms outside the products, 2-core Intel Xeon with AMX, 2026-12-07). Here the loop costs one call.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from tokenrouter.models import block_gemm
from tokenrouter.models.attention import paged_decode_kernel
from tokenrouter.models.attention.backend import KernelPlan
from tokenrouter.models.block_gemm import PackedBlocks
from tokenrouter.models.fused_ops import FusedOps
from tokenrouter.models.kv_pool import KVPool
from tokenrouter.models.native_build import load_library

SOURCE = Path(__file__).with_name("layer_loop.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-std=c11")  # no fast-math: the loop's own arithmetic is one add

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Functions(ctypes.Structure):
    _fields_ = [("gemm", _P), ("norm", _P), ("rotate", _P), ("silu", _P), ("attend", _P)]


class _Blocks(ctypes.Structure):
    _fields_ = [("codes", _P), ("d", _P), ("m", _P), ("bits", _I64), ("n", _I64), ("k", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("w", _Blocks * 4)]


class _Shape(ctypes.Structure):
    _fields_ = [("layers", _I64), ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("eps", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [("cos", _P), ("sin", _P), ("slots", _P), ("page_table", _P), ("reqs", _P), ("rows", _P),
                ("lens", _P), ("table_stride", _I64), ("page_size", _I64), ("kc", _P), ("vc", _P),
                ("layer_stride", _I64), ("scale", ctypes.c_float)]


class LoopLayer(NamedTuple):
    """One layer as the loop reads it: its norms' float32 weights and its four packed products
    (q/k/v, o, gate/up, down)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    products: tuple[PackedBlocks, PackedBlocks, PackedBlocks, PackedBlocks]


_ERRORS = {-2: "no memory for the loop's buffers", -101: "more query heads than the kernel's 256",
           -102: "a query row with no key to attend", -103: "no memory for the attention scores"}


class LayerLoop:
    """`__call__(x, rope, plan, pool)`: the hidden rows x [rows, hidden] float32 (at most `max_rows`)
    through every layer, in place, as `fused_forward` would leave them. Holds the layers' tensors."""

    def __init__(self, lib: ctypes.CDLL, ops: FusedOps, layers: Sequence[LoopLayer], heads: int, kv_heads: int,
                 head_dim: int, eps: float, max_rows: int) -> None:
        gemm, attend = block_gemm.load_kernel(), paged_decode_kernel.load_kernel()
        if gemm is None or attend is None:
            raise RuntimeError("the layer loop calls block_gemm and the paged decode kernel: both must be built")
        self._fn = lib.decode_layers
        self._fn.argtypes = [_P, _P, _P, _P, _P, _I64, ctypes.c_int]
        self._fn.restype = ctypes.c_int
        self._functions = _Functions(gemm.address, ops.addresses["norm"], ops.addresses["rotate"],
                                     ops.addresses["silu"], attend.address)
        self._layers = (_Layer * len(layers))()
        for slot, layer in zip(self._layers, layers):
            slot.input_norm, slot.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            for i, w in enumerate(layer.products):
                slot.w[i] = _Blocks(w.codes.data_ptr(), w.d.data_ptr(), None if w.m is None else w.m.data_ptr(),
                                    w.bits, w.out_features, w.in_features)
        self._kept = layers  # the tensors the pointers above point into
        hidden = layers[0].input_norm.shape[0]
        self._shape = _Shape(len(layers), hidden, heads, kv_heads, head_dim, eps)
        self.scale = head_dim ** -0.5
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], plan: KernelPlan,
                 pool: KVPool) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[0] <= self.max_rows
        assert pool.k.dtype == torch.float32 and pool.k.is_contiguous() and pool.v.is_contiguous()
        cos, sin = rope
        step = _Step(cos.data_ptr(), sin.data_ptr(), plan.out_slots.data_ptr(), plan.page_table.data_ptr(),
                     plan.reqs.data_ptr(), plan.rows.data_ptr(), plan.lens.data_ptr(), plan.page_table.stride(0),
                     pool.page_size, pool.k.data_ptr(), pool.v.data_ptr(), pool.k.stride(0), self.scale)
        rc = self._fn(ctypes.byref(self._functions), self._layers, ctypes.byref(self._shape), ctypes.byref(step),
                      x.data_ptr(), x.shape[0], torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"layer loop: {_ERRORS.get(rc, f'error {rc}')}")
        return x


@functools.cache
def load_library_once() -> ctypes.CDLL | None:
    """The loop's library, built once per source, compiler and CPU; None (logged) where it cannot be built."""
    return load_library(SOURCE, COMPILE_FLAGS, "decoder layer loop", "the layers loop in Python")
