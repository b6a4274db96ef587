"""Weight-only quantized products on torch's CPU kernels: GGUF blocks served as the file stores them
(group-32 int4, `torch.ops.aten._weight_int4pack_mm_for_cpu`), or a float weight as int8 per output
channel (`_weight_int8pack_mm`, the `--quantization int8` option for Hugging Face folders). Blocks go
to block_gemm.py's integer dot products instead where it serves the CPU (`on_block_gemm`: a linear
layer's, `for_layer`, and the head's screen's); `bounded_product` and `error_bound` cover both.

Both kernels are fast only on bfloat16 activations (AVX512-BF16 / AMX; on float32 ones torch runs a
reference loop 30x slower), so x is rounded to bfloat16 on the way in and the bfloat16 product
widened on the way out. The int4 kernel dequantizes each weight as (c - 8) s + z with a bfloat16
scale s and zero z per group of 32 along the row:
- Q4_0 (w = d (q - 8)): c = q, s = d, z = 0.
- Q4_1 (w = d q + m): c = q, s = d, z = m + 8 d.
- Q8_0 (w = d q, q int8): q = 16 h + l with h = q >> 4 in [-8, 7] and l = q & 15, so w = 16 d h + d l,
  two nibble planes laid side by side along the row, [h + 8 | l], with (s, z) = (16 d, 0) on the first
  and (d, 8 d) on the second, against x repeated twice: one product, summed in float32 inside.
The weights differ from the file's only by the rounding of d and m to bfloat16 (2^-9 relative).
`error_bound` bounds a product's error rigorously (the screened head's screen rests on it).

The kernel needs the output features in multiples of 16: padded with zero codes and scales, cut off.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from tokenrouter.models import block_gemm
from tokenrouter.models.block_gemm import PackedBlocks
from tokenrouter.models.gguf_weights import BLOCK, BlockWeight

_PAD = 16
# Inputs of up to this many rows take the quantized kernel, larger ones the float weights: the int4
# kernel's cost grows with the rows where the float products reuse each weight across rows. On
# SmolLM2's 30 layers (benchmarks/quantized_linear_costs.py, 2026-12-05) the quantized products were
# 4.1x / 4.6x the float ones at 1 row (one / two threads), 1.15x / 1.29x at 16 and 0.85x / 0.97x at 32.
MAX_ROWS = 16
# Where the weights also come as their values in bfloat16 on oneDNN (`wide`, where it runs them
# natively), the layers take those from this many rows on: the int4 kernel's cost steps up every four
# rows, oneDNN's bfloat16 (AMX) is flat to 16 rows. SmolLM2's 30 layers on two threads took 12.5 ms
# at 8 rows and 17.7 at 9 on the int4 kernel, 12.6 and 12.9 in bfloat16 (one thread: 23.1 / 28.0
# against 23.1 / 22.9); at 64 rows (a prompt chunk) 16.7 ms against 64.1 on the float32 weights
# (benchmarks/quantized_linear_costs.py, 2026-12-06). block_gemm's layers (`for_layer`) cross over at
# the same rows: 12.8 ms at 8 rows against oneDNN's 14.7, 16.3 at 12 (one tile of 4 rows costs as
# much as 4) against 14.2, on two threads (one thread: 19.6 / 28.4 against 27.4 / 28.0).
WIDE_ROWS = 9


class QuantizedLinear(NamedTuple):
    """A weight [out_features, in_features] for one of the two kernels (`group` 32: int4 against x
    repeated `repeat` times; `group` 0: int8 per channel, `scales` [n] bfloat16)."""

    packed: torch.Tensor
    scales: torch.Tensor
    group: int
    repeat: int
    out_features: int
    in_features: int


class _Planes(NamedTuple):
    """The int4 kernel's view of some blocks: codes [n, k * repeat] (0..15) and, per group of 32 along
    the row, float32 scale and zero [n, k * repeat / 32] (before their rounding to bfloat16)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    repeat: int


def _planes(w: BlockWeight) -> _Planes:
    d = w.scales
    if w.kind == "Q4_0":
        return _Planes(w.codes, d, torch.zeros_like(d), 1)
    if w.kind == "Q4_1":
        assert w.mins is not None
        return _Planes(w.codes, d, w.mins + 8 * d, 1)
    if w.kind == "Q8_0":
        q = w.codes.to(torch.int16)
        planes = torch.cat([(q >> 4) + 8, q & 15], dim=1)
        return _Planes(planes, torch.cat([16 * d, d], dim=1), torch.cat([torch.zeros_like(d), 8 * d], dim=1), 2)
    raise ValueError(f"no int4 layout for {w.kind} blocks")


def from_blocks(w: BlockWeight) -> QuantizedLinear:
    """The GGUF blocks of one weight for the int4 kernel (see the module's docstring)."""
    p = _planes(w)
    n, width = p.codes.shape
    padded = -(-n // _PAD) * _PAD
    c = torch.zeros(padded, width, dtype=torch.int32)
    c[:n] = p.codes.to(torch.int32)
    sz = torch.zeros(width // BLOCK, padded, 2, dtype=torch.bfloat16)
    sz[:, :n, 0] = p.scale.t().to(torch.bfloat16)
    sz[:, :n, 1] = p.zero.t().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c, 1)
    return QuantizedLinear(packed, sz, BLOCK, p.repeat, n, width // p.repeat)


def on_block_gemm(w: BlockWeight) -> bool:
    """Whether block_gemm takes these blocks: built on this CPU's integer dot products, a kind it
    holds, and (Q4_0, whose m is -8 d there) every -8 d within float16's range."""
    kernel = block_gemm.load_kernel()
    if kernel is None or not kernel.serves or w.kind not in block_gemm.KINDS:
        return False
    return w.kind != "Q4_0" or bool((8 * w.scales.abs() <= torch.finfo(torch.float16).max).all())


def for_layer(w: BlockWeight) -> QuantizedLinear | PackedBlocks:
    """A linear layer's blocks: on block_gemm (models/block_gemm.py) where it takes them, else torch's
    int4 kernel."""
    return block_gemm.pack(w) if on_block_gemm(w) else from_blocks(w)


def int8_per_channel(weight: torch.Tensor) -> QuantizedLinear:
    """A float weight [n, k] as int8 codes with one bfloat16 scale per output channel (symmetric,
    round to nearest: |w - s q| <= s / 2 plus the scale's rounding)."""
    w = weight.detach().float()
    s = (w.abs().amax(dim=1) / 127).to(torch.bfloat16)
    safe = torch.where(s == 0, torch.ones_like(s), s).float()
    q = torch.clamp(torch.round(w / safe[:, None]), -127, 127).to(torch.int8).contiguous()
    return QuantizedLinear(q, s, 0, 1, w.shape[0], w.shape[1])


def product(xb: torch.Tensor, w: QuantizedLinear | PackedBlocks) -> torch.Tensor:
    """xb [rows, in_features] bfloat16 times the quantized weight: the kernel's bfloat16 [rows,
    out_features] (a view of its padded output where out_features is not a multiple of 16)."""
    if isinstance(w, PackedBlocks):
        return block_gemm.product(xb, w, torch.bfloat16)
    if w.group == 0:
        return torch.ops.aten._weight_int8pack_mm(xb.contiguous(), w.packed, w.scales)
    if w.repeat > 1:
        xb = xb.repeat(1, w.repeat)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), w.packed, w.group, w.scales)
    return y if y.shape[1] == w.out_features else y[:, :w.out_features]


def linear(x: torch.Tensor, w: QuantizedLinear | PackedBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in_features] times the quantized weight (plus bias), in x's dtype."""
    y = product(x.to(torch.bfloat16), w).to(x.dtype)
    return y if bias is None else y + bias


def bounded_product(x: torch.Tensor, w: QuantizedLinear | PackedBlocks) -> torch.Tensor:
    """x [rows, in_features] float32 times the quantized weight, float32: the product `error_bound`
    bounds (torch's kernels through bfloat16, as `linear`; block_gemm on x as it is, unrounded)."""
    if isinstance(w, PackedBlocks):
        return block_gemm.product(x, w, torch.float32)
    return linear(x, w)


_UB, _U = 2.0 ** -8, 2.0 ** -24  # unit roundoffs of bfloat16 and float32


class ErrorBound(NamedTuple):
    """|bounded_product(x, w)[r, j] - x_r . reference_j| <= ||x_r|| columns[j] + flushed (1 + max_i |x_ri|),
    the product on the right exact (real arithmetic) and `reference` the float32 weights [n, k].

    The derivation for torch's kernels (block_gemm's: `_block_gemm_bound`), per column j, with K' = K r
    the kernel's row (r = 1, or 2 for Q8_0's two nibble planes against x repeated) and ||x'|| =
    sqrt(r) ||x||: the kernel rounds x to bfloat16 (u_b), may
    round each dequantized weight to bfloat16 or compute it in float32 (R_j = (u_b + 2u) M_j covers
    both, M_j the norm of |c - 8| |s| + |z|, which bounds what it multiplies element by element),
    sums in float32 in any grouping (g' for K' + 2 terms) and rounds the sum to bfloat16 (u_b); the
    weights it represents differ from the reference by D_j in norm (scales rounded to bfloat16):
        columns[j] = sqrt(r) ((u_b (1 + g') (1 + u_b) + g' (1 + u_b) + u_b) (M_j + R_j) + R_j) + D_j,
    taken 1e-6 larger; `flushed` covers the subnormal inputs, products and sums the kernels may flush
    to zero (each term off by under 3 * 2^-126 (1 + |x_i|)(1 + |w_i|)), over K' terms."""

    columns: torch.Tensor  # float64 [n]
    flushed: float


def error_bound(w: QuantizedLinear | PackedBlocks, source: BlockWeight | None, reference: torch.Tensor,
                chunk: int = 4096) -> ErrorBound:
    """The bound (ErrorBound) of `bounded_product` for `w`, made from `source` blocks or, with None, by
    int8_per_channel, against the float32 `reference` [n, k]; `chunk` rows at a time, bounding the
    float64 temporaries."""
    if isinstance(w, PackedBlocks):
        assert source is not None, "block_gemm's weights are a file's blocks"
        return _block_gemm_bound(w, source, reference, chunk)
    n, k = w.out_features, w.in_features
    magnitude, offset = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    largest = 0.0
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        if source is None:
            values = w.packed[a:b].double() * w.scales[a:b].double()[:, None]
            mag = values.abs()
        else:
            p = _planes(source.rows(slice(a, b)))
            s = p.scale.to(torch.bfloat16).double().repeat_interleave(BLOCK, dim=1)
            z = p.zero.to(torch.bfloat16).double().repeat_interleave(BLOCK, dim=1)
            centred = p.codes.double() - 8
            mag = centred.abs() * s.abs() + z.abs()
            values = centred * s + z
            if p.repeat > 1:
                values = values.view(b - a, p.repeat, k).sum(dim=1)
        magnitude[a:b] = torch.linalg.vector_norm(mag, dim=1)
        largest = max(largest, float(mag.max()))
        offset[a:b] = torch.linalg.vector_norm(values - reference[a:b].double(), dim=1)
    terms = k * w.repeat
    g = (terms + 2) * _U / (1 - (terms + 2) * _U)
    rounding = (_UB + 2 * _U) * magnitude
    c = _UB * (1 + g) * (1 + _UB) + g * (1 + _UB) + _UB
    columns = (math.sqrt(w.repeat) * (c * (magnitude + rounding) + rounding) + offset) * (1 + 1e-6)
    return ErrorBound(columns, 3 * terms * 2.0 ** -126 * (1 + largest * (1 + _UB)))


def _block_gemm_bound(w: PackedBlocks, source: BlockWeight, reference: torch.Tensor, chunk: int) -> ErrorBound:
    """block_gemm's float32 product on float32 x (models/block_gemm.c's arithmetic), per column j,
    with B = k / 32 blocks and max |x| <= ||x||:
    - each input stands as its two int8 codes to within dx_b (1/508 + 1e-4) (the remainder's rounding
      plus the float32 rounding of x / dx), dx_b = max |x_b| / 127 rounded, at most max |x| (1 + u)
      / 127; times |d q| summed along the row: rep * ||d q_j||_1 max |x|;
    - the int32 sums are exact; their conversion, the scales' products, the blocks' float32 sums of x
      (31 roundings each, times |m|) and the 2B multiply-adds over the blocks round at most 2B + 40
      times on terms of at most ||d q_j||_1 max |x| (1 + 1/254) and ||m_j||_1 max |x|: g (1 + 1/254)
      (||d q_j||_1 + ||m_j||_1) max |x|;
    - the reference's float32 values against the blocks' exact d q + m: ||offset_j||_1 max |x|;
    and an absolute term for results that fall below float32's normal range (no flush to zero there:
    each of the 3B + 8 roundings is then off by at most 2^-149). The kernel scales a row whose largest
    input is outside 2^-60..2^60 by the power of two that brings it into [1, 2), exactly, and back (the
    final rounding under the absolute term); a block under 2^-100 of the row's largest input reads as
    zero, and an input rounded as its row scales down moves by under 2^-100 of it: each under 2^-100
    max |x| ||d q_j||_1, inside g's term."""
    n, k = w.out_features, w.in_features
    blocks = k // BLOCK
    l1_dq, l1_m, offset = (torch.empty(n, dtype=torch.float64) for _ in range(3))
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        part = source.rows(slice(a, b))
        d = part.scales.double().repeat_interleave(BLOCK, dim=1)
        dq = d * part.codes.double()
        if part.kind == "Q4_1":
            assert part.mins is not None
            m = part.mins.double().repeat_interleave(BLOCK, dim=1)
        else:
            m = -8 * d if part.kind == "Q4_0" else torch.zeros_like(d)
        l1_dq[a:b], l1_m[a:b] = dq.abs().sum(dim=1), m.abs().sum(dim=1)
        offset[a:b] = (dq + m - reference[a:b].double()).abs().sum(dim=1)
    terms = 2 * blocks + 40
    g = terms * _U / (1 - terms * _U)
    rep = (1 + _U) * (1 / 508 + 1e-4) / 127
    columns = (rep * l1_dq + g * (1 + 1 / 254) * (l1_dq + l1_m) + offset) * (1 + 1e-6)
    return ErrorBound(columns, (3 * blocks + 8) * 2.0 ** -149)
