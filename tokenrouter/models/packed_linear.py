"""The linear layers' products on prepacked weights, for float32 on CPU, one rank: the skinny GEMM
(skinny_gemm.py) for inputs of up to `onednn_linear.MAX_EXACT_ROWS` rows (decode batches, short
extends, the head's sampled rows, and the tails of larger inputs), oneDNN (onednn_linear.py) for the
row blocks of larger inputs (prefill chunks, batched catch-up extends).

Why both: per decode step at SmolLM2's shapes the skinny kernel measured 1.8x oneDNN at 1 row,
1.35x at 8, 1.1-1.2x at 12-24 and even at 64 (benchmarks/skinny_gemm_costs.py); past 64 rows
oneDNN's blocking reuses each weight for more rows than the skinny tile holds. With the skinny kernel
oneDNN only ever sees the `BLOCK_ROWS` counts, so it keeps five primitives per weight shape instead
of 69. Without a C compiler, oneDNN takes every row count (`skinny` None), and so it does while a step
runs on more than one torch thread (the skinny kernel runs on one; oneDNN spreads over the others).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenrouter.models import onednn_linear, skinny_gemm


class PackedLinear(NamedTuple):
    """One weight [out_features, in], packed for oneDNN and (with the kernel) in skinny panels."""

    onednn: torch.Tensor
    panels: torch.Tensor | None
    out_features: int
    skinny: skinny_gemm.SkinnyGemm | None


def pack(weight: torch.Tensor, skinny: skinny_gemm.SkinnyGemm | None) -> PackedLinear:
    panels = None if skinny is None else skinny_gemm.pack(weight)
    return PackedLinear(onednn_linear.pack(weight), panels, weight.shape[0], skinny)


def linear(x: torch.Tensor, w: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] times the packed weight (plus bias)."""
    if w.skinny is None or torch.get_num_threads() > 1:  # the skinny kernel runs on one thread
        return onednn_linear.linear(x, w.onednn, bias)
    rows = x.shape[0]
    if rows <= onednn_linear.MAX_EXACT_ROWS:
        return w.skinny(x, w.panels, w.out_features, bias)
    blocks = onednn_linear.row_blocks(rows)
    if len(blocks) == 1:
        return onednn_linear.product(x, w.onednn, bias)
    x = x.contiguous()
    out = torch.empty(rows, w.out_features, dtype=x.dtype)
    start = 0
    for n in blocks:
        part = x[start:start + n]
        if n <= onednn_linear.MAX_EXACT_ROWS:
            w.skinny(part, w.panels, w.out_features, bias, out=out[start:start + n])
        else:
            out[start:start + n] = onednn_linear.product(part, w.onednn, bias)
        start += n
    return out


def warm_up(weights: list[tuple[torch.Tensor, PackedLinear]], max_rows: int) -> None:
    """Create oneDNN's primitives for every row count it will see in inputs of up to `max_rows` rows
    (only the large blocks when the skinny kernel takes the rest)."""
    skinny = any(p.skinny is not None for _, p in weights)
    onednn_linear.warm_up([(w, p.onednn) for w, p in weights], max_rows, exact_rows=not skinny)
