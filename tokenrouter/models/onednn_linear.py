"""Linear layers on oneDNN with prepacked weights, for float32 on CPU.

PyTorch's `F.linear` on CPU multiplies the weight in its stored layout for every call; at the small
row counts of decoding (one row per running request) that leaves most of a core's throughput unused.
oneDNN reorders the weight once, at load, into the blocked layout its kernels stream from: measured on
SmolLM2-135M's shapes at 8 and 32 rows, 2.4-2.7x faster per matmul (docs/BENCHMARKS.md, issue 15),
which is where vLLM's CPU build takes its lead. The arithmetic is the same sum in another order.
"""

from __future__ import annotations

import torch


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered for `linear` (an opaque oneDNN tensor; the original stays)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
