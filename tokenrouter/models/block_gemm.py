"""GGUF blocks (Q4_0, Q4_1, Q8_0) times a few rows on the CPU's integer dot-product instructions
(block_gemm.c, built on first use by native_build.py): each row's blocks of 32 inputs as int8 codes
on one float scale per block (a coarse code and its rounded remainder, a 64,000th of the block's
largest input at worst), the products of the file's codes with them summed exactly in int32
(AVX512-VNNI), scaled in float32 by the file's own float16 d and m.

Why it exists: torch's int4 kernel (quantized_linear.py) widens each code to a float and multiplies
in floating point, and runs Q8_0 blocks as two nibble planes; at decoding's row counts that work,
not the memory, bounds it. The integer dot products stream the same bytes with a fraction of the
instructions (benchmarks/quantized_linear_costs.py). `serves` says where it is built for the CPU's
dot-product instructions; elsewhere the library still builds, on a plain C loop with the same
arithmetic (the tests' anchor on any machine), and the layers keep torch's kernel.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from tokenrouter.models.gguf_weights import BLOCK, BlockWeight
from tokenrouter.models.native_build import load_library

SOURCE = Path(__file__).with_name("block_gemm.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=gnu11", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
PANEL = 16
KINDS = ("Q4_0", "Q4_1", "Q8_0")


class PackedBlocks(NamedTuple):
    """A [out_features, in_features] block weight in block_gemm.c's layout: `codes` uint8 [panels,
    blocks, groups, 16, 4] (`bits` 4: two codes a byte, 4 groups; 8, Q8_0: the code plus 128, 8
    groups), `d` and `m` float16 [panels, blocks, 16] (w = d q + m; `m` None for Q8_0)."""

    codes: torch.Tensor
    bits: int
    d: torch.Tensor
    m: torch.Tensor | None
    out_features: int
    in_features: int


def pack(w: BlockWeight) -> PackedBlocks:
    """The blocks of `w` in the kernel's layout, d and m exactly the file's float16 values."""
    if w.kind not in KINDS:
        raise ValueError(f"block_gemm serves {', '.join(KINDS)} blocks, not {w.kind}")
    n, k = w.shape
    panels, blocks = -(-n // PANEL), k // BLOCK
    codes = torch.zeros(panels * PANEL, k, dtype=torch.int16)
    codes[:n] = w.codes.to(torch.int16)
    bits = 8 if w.kind == "Q8_0" else 4
    if bits == 8:  # [panel, column, block, group, input] -> [panel, block, group, column, input]
        grouped = (codes + 128).to(torch.uint8).view(panels, PANEL, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    else:  # [panel, column, block, group, half, input]: inputs 8g + i in the low nibble, 8g + 4 + i in the high
        c = codes.to(torch.uint8).view(panels, PANEL, blocks, 4, 2, 4)
        grouped = (c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)

    def per_panel(v: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(panels * PANEL, blocks, dtype=torch.float32)
        padded[:n] = v
        return padded.view(panels, PANEL, blocks).transpose(1, 2).to(torch.float16).contiguous()

    m = None if bits == 8 else per_panel(w.mins if w.kind == "Q4_1" else -8 * w.scales)
    return PackedBlocks(grouped.contiguous(), bits, per_panel(w.scales), m, n, k)


class BlockGemm:
    """`__call__(x, w, out_dtype)`: x [rows, in_features] (float32 or bfloat16, rows of unit stride)
    times the packed weight, as a new [rows, out_features] tensor of `out_dtype` (float32 or
    bfloat16), on torch's thread count. `serves`: built on the CPU's integer dot products (where it
    beats torch's kernel)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = lib.block_gemm
        self._fn.argtypes = [ptr, i32, i64, i64, ptr, i32, ptr, ptr, i64, ptr, i32, i32]
        self._fn.restype = ctypes.c_int
        self.serves = bool(lib.block_gemm_vnni())
        self.address: int = ctypes.cast(self._fn, ctypes.c_void_p).value  # for C callers (layer_loop.c)

    def __call__(self, x: torch.Tensor, w: PackedBlocks, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16) or out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"block_gemm takes and gives float32 or bfloat16, not {x.dtype} -> {out_dtype}")
        assert x.shape[-1] == w.in_features
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.out_features, dtype=out_dtype)
        rc = self._fn(x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], w.in_features, w.codes.data_ptr(), w.bits,
                      w.d.data_ptr(), None if w.m is None else w.m.data_ptr(), w.out_features, y.data_ptr(),
                      out_dtype == torch.bfloat16, torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"block_gemm: no memory for the rounded inputs of {x.shape[0]} rows")
        return y


@functools.cache
def load_kernel() -> BlockGemm | None:
    """The kernel, built once per source, compiler and CPU; None (logged) where it cannot be built."""
    lib = load_library(SOURCE, COMPILE_FLAGS, "GGUF block GEMM",
                       "GGUF block layers and the head's screen stay on torch's kernels", LINK_FLAGS)
    return None if lib is None else BlockGemm(lib)


def product(x: torch.Tensor, w: PackedBlocks, out_dtype: torch.dtype) -> torch.Tensor:
    """x times blocks `pack` made: the kernel's product (blocks are packed only where it is built)."""
    kernel = load_kernel()
    assert kernel is not None, "blocks are packed for block_gemm only where it is built"
    return kernel(x, w, out_dtype)
