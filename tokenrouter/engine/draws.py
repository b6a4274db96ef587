"""Counter-based random draws: a pure function of (seed, position, stream), vectorised over a batch.

Routing decisions drawn this way are reproducible whatever the batch, the process or the model
that draws them, and need no state carried with a request.
"""

from __future__ import annotations

import torch


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    # splitmix64's finaliser; int64 multiplication wraps modulo 2**64.
    x = x + _GOLDEN
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def uniform(seeds: list[int], positions: list[int], stream: int) -> torch.Tensor:
    """One float64 draw in [0, 1) per (seed, position), independent across streams."""
    s = torch.tensor(seeds, dtype=torch.int64)
    p = torch.tensor(positions, dtype=torch.int64)
    x = _mix(_mix(s ^ stream) + p)
    return _lsr(x, 11).double() / float(1 << 53)
