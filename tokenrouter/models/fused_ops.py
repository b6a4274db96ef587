"""The fused element-wise ops (fused_ops.c) for float32 on CPU (and the bfloat16 the quantized products
read and write, where a layer hands rows to them): RMSNorm with its residual add, the
rotary rotation, SiLU(gate) * up and the greedy argmax, each one C call instead of several PyTorch
ops, built on first use (tokenrouter/models/native_build.py).

Why: with the products on the skinny GEMM, a SmolLM2 decode step at batch 8 spent 12.4 of 53.3 ms
outside the products (benchmarks/step_without_products.py, in git history), most of it in dispatching
small ops: PyTorch's RMSNorm alone ran eight ops, 29 us a call for 8 x 576 floats. The layers call these
where the model was given them (`LlamaForCausalLM.use_fused_ops`) and the input is a float32 CPU tensor
of the plain layout; everything else keeps the PyTorch ops, which the tests compare them with.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from tokenrouter.models.native_build import load_library

SOURCE = Path(__file__).with_name("fused_ops.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-ffp-contract=off", "-fopenmp-simd", "-std=c11")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _checked(op: str, rc: int | None) -> None:
    if rc == -2:
        raise MemoryError(f"fused {op}: no memory for a scratch row")


class FusedOps:
    """Each method takes float32 CPU tensors (or bfloat16 where it says) laid out as it says and
    returns new tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._norm = lib.add_rms_norm_f32
        self._norm.argtypes = [ptr, i64, ptr, ptr, f32, i64, i64, i64, ptr, ptr]
        self._norm_bf16 = lib.add_rms_norm_bf16
        self._norm_bf16.argtypes = [ptr, i64, i64, ptr, ptr, f32, i64, i64, ptr, ptr]
        self._rotate = lib.rotate_f32
        self._rotate.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
        self._silu_mul = {torch.float32: lib.silu_mul_f32, torch.bfloat16: lib.silu_mul_bf16}
        self._argmax = lib.argmax_f32
        self._argmax.argtypes = [ptr, i64, i64, i64, ptr]
        for fn in (self._norm, self._rotate, self._silu_mul[torch.float32], self._argmax):
            fn.restype = None
        for fn in (self._norm_bf16, self._silu_mul[torch.bfloat16]):
            fn.restype = ctypes.c_int  # 0, or -2: no memory for the scratch row
        for fn in self._silu_mul.values():
            fn.argtypes = [ptr, i64, i64, i64, ptr]
        # For C callers (layer_loop.c): the bfloat16 norm, the rotation and the bfloat16 SiLU.
        self.addresses: dict[str, int] = {name: ctypes.cast(fn, ctypes.c_void_p).value for name, fn in (
            ("norm", self._norm_bf16), ("rotate", self._rotate), ("silu", self._silu_mul[torch.bfloat16]))}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, dim] with unit stride along dim, or [rows, heads, dim] with each row's heads side by
        side (any row stride; then no residual); residual float32 [rows, dim], contiguous. Returns
        (h, norm(h) * weight), contiguous, with h = x + residual in float32, or x itself without a
        residual. x may be bfloat16 with a residual, and the norm's out_dtype bfloat16 (2-D x): a
        quantized product's output in, its input out (bit for bit what the float32 op and torch's
        conversions give)."""
        if x.dtype == torch.bfloat16 or out_dtype == torch.bfloat16:
            if x.dim() != 2 or (x.dtype == torch.bfloat16 and residual is None):
                raise ValueError(f"fused rms_norm: bfloat16 x {tuple(x.shape)} needs 2-D rows and a residual")
            out = torch.empty(x.shape, dtype=out_dtype)
            h = x if residual is None else torch.empty(x.shape, dtype=torch.float32)
            _checked("rms_norm", self._norm_bf16(x.data_ptr(), x.dtype == torch.bfloat16, x.stride(0), _ptr(residual),
                                                 weight.data_ptr(), eps, x.shape[0], x.shape[1],
                                                 None if residual is None else h.data_ptr(), out.data_ptr()))
            return h, out
        rows, dim = x.shape[0], x.shape[-1]
        heads = x.shape[1] if x.dim() == 3 else 1
        out = torch.empty(x.shape, dtype=torch.float32)
        h = x if residual is None else torch.empty_like(x)
        self._norm(x.data_ptr(), x.stride(0), _ptr(residual), weight.data_ptr(), eps, rows, heads, dim,
                   None if residual is None else h.data_ptr(), out.data_ptr())
        return h, out

    @staticmethod
    def rows_of(x: torch.Tensor) -> bool:
        """Whether x is laid out as these ops read it: float32 on CPU, [rows, width] with unit stride,
        or [rows, heads, dim] with each row's heads side by side."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1:
            return False
        return x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2])

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [rows, heads, d] with each row's heads side by side (any row stride); cos and sin
        [rows, 1, d] contiguous, as `RotaryEmbedding.angles` gives them. Returns [rows, heads, d]."""
        rows, heads, d = x.shape
        out = torch.empty(rows, heads, d, dtype=torch.float32)
        self._rotate(x.data_ptr(), x.stride(0), rows, heads, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2n] with unit stride, float32 or bfloat16: silu(gate_up[:, :n]) * gate_up[:, n:],
        in its dtype (bfloat16: computed in float32, then rounded)."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        _checked("silu_mul", self._silu_mul[gate_up.dtype](gate_up.data_ptr(), gate_up.stride(0), rows, width // 2,
                                                           out.data_ptr()))
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, n] with unit stride: each row's first index of its largest value (int64 [rows])."""
        rows, n = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(x.data_ptr(), x.stride(0), rows, n, out.data_ptr())
        return out


@functools.cache
def load_kernel() -> FusedOps | None:
    """The ops, built once per source, compiler and CPU; None (logged) where they cannot be built."""
    lib = load_library(SOURCE, COMPILE_FLAGS, "fused element-wise ops", "norms, rotary and SiLU stay on PyTorch")
    return None if lib is None else FusedOps(lib)
