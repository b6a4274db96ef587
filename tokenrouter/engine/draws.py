"""Counter-based random draws: a pure function of (seed, position, stream), vectorised over a batch.

Routing decisions drawn this way are reproducible whatever the batch, the process or the model
that draws them, and need no state carried with a request. The arithmetic is numpy's uint64 (it
wraps modulo 2**64, as splitmix64 wants): a few microseconds a batch, where torch's per-op overhead
cost ten times more on the decode loop's hot path.
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser
    x = x + _GOLDEN
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def _u64(values: list[int]) -> np.ndarray:
    """Python ints (negative ones as two's complement) as uint64."""
    return np.array(values, dtype=np.int64).view(np.uint64)


def uniform(seeds: list[int], positions: list[int], stream: int) -> torch.Tensor:
    """One float64 draw in [0, 1) per (seed, position), independent across streams."""
    x = _mix(_mix(_u64(seeds) ^ _u64([stream])) + _u64(positions))
    return torch.from_numpy((x >> _S11).astype(np.float64) / float(1 << 53))
