"""Building blocks shared by the model families: RMSNorm, rotary embedding, gated MLP (tensor parallel)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenrouter.models.fused_ops import FusedOps
from tokenrouter.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from tokenrouter.models.tp_group import TPGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused: FusedOps | None = None  # set by use_fused_ops (float32 CPU only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and FusedOps.rows_of(x):  # hidden rows, or Qwen3's heads of q or k
            return self.fused.rms_norm(x, self.weight, self.eps)[1]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op: the same products in the same order as normalising, then scaling (bit-identical).
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        # Normalise in float32 as the reference does, whatever the model dtype.
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm): the residual stream's sum and the next block's input, in one
        pass where fused."""
        if self.fused is not None and x.dim() == 2 and FusedOps.rows_of(x) and x.is_contiguous() \
                and residual.is_contiguous():
            return self.fused.rms_norm(x, self.weight, self.eps, residual)
        h = residual + x
        return h, self(h)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # float32, as the Hugging Face reference computes it, so positions get bit-identical angles.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate between.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


# Each row's position's angles as [T, 1, head_dim]: (cos | cos, -sin | sin), so that a rotation is
# x * cos + swap_halves(x) * sin, the reference's x1 cos - x2 sin and x2 cos + x1 sin term for term.
Rope = tuple[torch.Tensor, torch.Tensor]


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a cos/sin table for every position up to max_positions.

    `angles` looks a step's positions up once; every layer then applies them with `rotate`. The tables
    hold each position's angles as Rope lays them out (twice the bytes of cos and sin alone), so that a
    step looks them up with two indexing calls rather than six calls a step."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv.float())
        cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def angles(self, positions: torch.Tensor) -> Rope:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, rope: Rope, fused: FusedOps | None = None) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by its row's angles (computed in float32, returned in x's dtype).
    Any number of heads: a layer rotates q and k as one tensor, halving the element-wise calls.
    `fused`: one C pass (bit-identical) where x's heads lie side by side in each row."""
    cos, sin = rope
    if fused is not None and FusedOps.rows_of(x):
        return fused.rotate(x, cos, sin)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul.

    Under tensor parallelism each rank holds intermediate / tp columns: its slice of gate and of up,
    fused as [gate_r; up_r] (column-parallel), and the matching rows of down (row-parallel: the
    partial sums are all-reduced)."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup.single()
        self.intermediate = intermediate // tp.size  # this rank's share
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * self.intermediate, False, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp)
        self.fused: FusedOps | None = None  # set by use_fused_ops (float32 CPU only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and FusedOps.rows_of(gate_up):
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
