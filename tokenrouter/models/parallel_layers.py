"""Tensor-parallel layers. With a group of size 1 each is exactly its plain counterpart (same
parameter shapes, same arithmetic), so the single-process engine is unchanged.

- `ColumnParallelLinear`: the output features are split; each rank holds its rows of the weight and
  returns its slice of the output (no communication). Fused q/k/v and gate/up are column-parallel
  with the *fusion done per shard*: rank r holds [q_r; k_r; v_r] (its heads' q, k and v) and
  [gate_r; up_r], so the local output splits exactly as the unsharded one does.
- `RowParallelLinear`: the input features are split; each rank multiplies its slice and the partial
  sums are all-reduced (the bias, if any, is added once, after the sum).
- `VocabParallelEmbedding`: rank r holds vocabulary rows [r * Vp, (r + 1) * Vp) (Vp = ceil(V / tp),
  the last shard padded with zero rows); ids outside the slice look up zeros and the all-reduce
  fills them in.
- `ParallelLMHead`: the same vocabulary split; `logits` computes the local slice and all-gathers the
  full row on every rank (the padding is cut off).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenrouter.models import onednn_linear, packed_linear, quantized_linear
from tokenrouter.models.block_gemm import PackedBlocks
from tokenrouter.models.tp_group import TPGroup


class _Linear(nn.Module):
    """A linear layer's product on one rank: the quantized weight for inputs of up to `quantized_rows`
    rows where it has one (models/quantized_linear.py), the weight's values in bfloat16 on oneDNN
    above that where it has them (`wide`), else the prepacked float weight where packed
    (models/packed_linear.py), else F.linear."""

    def __init__(self, out_features: int, in_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: packed_linear.PackedLinear | None = None  # pack_linear_weights
        self.quantized: quantized_linear.QuantizedLinear | PackedBlocks | None = None  # quantize_linear_weights
        self.wide: torch.Tensor | None = None  # quantize_linear_weights: bfloat16, packed for oneDNN

    @property
    def quantized_rows(self) -> int:
        """The most rows of an input the quantized weight takes."""
        return quantized_linear.MAX_ROWS if self.wide is None else quantized_linear.WIDE_ROWS - 1

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.quantized_rows:
            return quantized_linear.linear(x, self.quantized, bias)
        if self.wide is not None:
            y = onednn_linear.linear(x.to(torch.bfloat16), self.wide, None).to(x.dtype)
            return y if bias is None else y + bias
        if self.packed is not None:
            return packed_linear.linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features_local: int, bias: bool, tp: TPGroup) -> None:
        """`out_features_local`: this rank's output features."""
        super().__init__(out_features_local, in_features, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class RowParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        """`in_features`: the full input width; this rank holds in_features / tp of its columns."""
        super().__init__(out_features, in_features // tp.size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.product(x, self.bias)
        out = self.tp.all_reduce(self.product(x, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = math.ceil(vocab_size / tp.size)  # rows per rank (the last shard may be padded)
        self.start = min(vocab_size, tp.rank * self.rows)
        self.end = min(vocab_size, self.start + self.rows)  # real rows: [start, end)
        self.weight = nn.Parameter(torch.zeros(self.rows, dim))  # padding rows stay zero

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.start) & (ids < self.end)
        local = F.embedding(torch.where(inside, ids - self.start, 0), self.weight)
        local = local.masked_fill(~inside[:, None], 0.0)
        return self.tp.all_reduce(local)


class ParallelLMHead(nn.Module):
    """The output projection's vocabulary shard (the same split as `VocabParallelEmbedding`)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = math.ceil(vocab_size / tp.size)
        self.start = min(vocab_size, tp.rank * self.rows)
        self.end = min(vocab_size, self.start + self.rows)
        self.weight = nn.Parameter(torch.zeros(self.rows, dim))  # padding rows stay zero


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup,
                    packed: packed_linear.PackedLinear | None = None) -> torch.Tensor:
    """Full logits [N, V] on every rank from each rank's vocabulary shard of the output weight
    (`packed`: that weight prepacked, models/packed_linear.py)."""
    local = hidden @ weight.t() if packed is None else packed_linear.linear(hidden, packed, None)
    if tp.size == 1:
        return local
    return tp.all_gather(local, dim=-1)[:, :vocab_size]
