"""Linear layers on oneDNN with prepacked weights, for float32 on CPU.

PyTorch's `F.linear` on CPU multiplies the weight in its stored layout for every call; at the small
row counts of decoding (one row per running request) that leaves most of a core's throughput unused.
oneDNN reorders the weight once, at load, into the blocked layout its kernels stream from: measured on
SmolLM2-135M's shapes at 8 and 32 rows, 2.4-2.7x faster per matmul (docs/BENCHMARKS.md, issue 15),
which is where vLLM's CPU build takes its lead. The arithmetic is the same sum in another order.

oneDNN keeps a primitive and a scratchpad per input shape, about 1.3 MB of resident memory per row
count and weight shape, measured: a server whose batches take every row count up to the chunked
prefill size would grow by gigabytes. So only decode-sized inputs (at most MAX_ROWS rows) run here,
larger ones (prefill chunks, where F.linear is efficient) stay on F.linear, and `warm_up` visits every
row count once at load, so resident memory reaches its plateau before serving starts.
"""

from __future__ import annotations

import torch


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered for `linear` (an opaque oneDNN tensor; the original stays)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] > MAX_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def warm_up(weights: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Run each distinct weight shape of (weight, packed) pairs at every row count up to MAX_ROWS
    (twice: oneDNN's memory settles on the second pass, measured)."""
    shapes = {tuple(w.shape): (w, p) for w, p in weights}
    for _ in range(2):
        for rows in range(1, MAX_ROWS + 1):
            for w, p in shapes.values():
                linear(w.new_zeros(rows, w.shape[1]), w, p, None)
