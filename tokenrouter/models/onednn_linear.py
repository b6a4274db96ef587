"""Linear layers on oneDNN with prepacked weights, for float32 on CPU.

PyTorch's `F.linear` on CPU multiplies the weight in its stored layout for every call; at the small
row counts of decoding (one row per running request) that leaves most of a core's throughput unused.
oneDNN reorders the weight once, at load, into the blocked layout its kernels stream from: measured on
SmolLM2-135M's shapes at 8 and 32 rows, 2.4-2.7x faster per matmul, and 1.1-1.6x at 64 to 2048 rows
(prefill chunks and batched catch-up extends; docs/BENCHMARKS.md). The arithmetic is the same sum in
another order.

oneDNN keeps a primitive per input shape, with its own memory (about 0.6 MB per row count and layer
weight shape, measured on SmolLM2's shapes): a server whose steps took every row count up to the
chunked prefill size would grow by gigabytes. So products run only at a fixed set of row counts:
every count up to MAX_EXACT_ROWS (decode batches, run whole), and larger inputs cut into blocks of
BLOCK_ROWS rows plus a tail of at most MAX_EXACT_ROWS rows (a tail of 65-127 rows as 64 and the rest).
No row is padded: every tail already has its primitive. So each weight shape has at most
MAX_EXACT_ROWS + len(BLOCK_ROWS) primitives, and `warm_up` creates them at load, so resident memory
reaches its plateau before serving starts.
"""

from __future__ import annotations

import torch

MAX_EXACT_ROWS = 64
BLOCK_ROWS = (2048, 1024, 512, 256, 128)  # largest first; per-row cost is flat from 256 rows (measured)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def bfloat16_available() -> bool:
    """Whether oneDNN runs bfloat16 products natively here (AVX512-BF16 or AMX), not emulated."""
    return available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered for `linear` (an opaque oneDNN tensor; the original stays)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def row_blocks(rows: int) -> list[int]:
    """The row counts a product over `rows` input rows runs as, in order (they sum to `rows`)."""
    out = []
    for block in BLOCK_ROWS:
        while rows - block >= 0 and rows > MAX_EXACT_ROWS:
            out.append(block)
            rows -= block
    if rows > MAX_EXACT_ROWS:  # 65..127 left: no block fits
        out.append(MAX_EXACT_ROWS)
        rows -= MAX_EXACT_ROWS
    if rows:
        out.append(rows)
    return out


def product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One oneDNN product at x's own row count (which should be one of `row_blocks`' counts)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] times the packed weight (plus bias), at the fixed row counts of `row_blocks`."""
    rows = x.shape[0]
    if rows <= MAX_EXACT_ROWS:
        return product(x, packed, bias)
    x = x.contiguous()
    parts, start = [], 0
    for n in row_blocks(rows):
        parts.append(product(x[start:start + n], packed, bias))
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def warm_up(weights: list[tuple[torch.Tensor, torch.Tensor]], max_rows: int, exact_rows: bool = True,
            min_rows: int = 1) -> None:
    """Run each distinct weight shape of (weight, packed) pairs at every row count it can see in
    inputs of `min_rows` to `max_rows` rows (twice: oneDNN's memory settles on the second pass,
    measured), in the weights' dtype; `exact_rows` False: only the blocks (another kernel takes the
    counts up to MAX_EXACT_ROWS)."""
    shapes = {tuple(w.shape): (p, w.dtype) for w, p in weights}
    exact = list(range(min_rows, min(max_rows, MAX_EXACT_ROWS) + 1)) if exact_rows else []
    counts = exact + [b for b in BLOCK_ROWS if b <= max_rows]
    for _ in range(2):
        for rows in counts:
            for (_, width), (p, dtype) in shapes.items():
                product(torch.zeros(rows, width, dtype=dtype), p, None)
