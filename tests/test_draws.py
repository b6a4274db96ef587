"""Counter-based draws against splitmix64 written out in plain Python integers."""

from __future__ import annotations

import random

import torch

from tokenrouter.engine.draws import uniform

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _reference(seed: int, position: int, stream: int) -> float:
    x = _mix((_mix((seed & _MASK) ^ stream) + position) & _MASK)
    return (x >> 11) / float(1 << 53)


def test_uniform_is_splitmix64_of_seed_stream_and_position():
    rng = random.Random(3)
    seeds = [rng.getrandbits(63) for _ in range(50)] + [0, 1, (1 << 63) - 1, -7]
    positions = [rng.randrange(1 << 24) for _ in seeds]
    for stream in (0, 0x5EED_B0B, 0x70CE_4A11):
        got = uniform(seeds, positions, stream)
        assert got.dtype == torch.float64 and got.shape == (len(seeds),)
        assert got.tolist() == [_reference(s, p, stream) for s, p in zip(seeds, positions)]
        assert ((got >= 0) & (got < 1)).all()


def test_uniform_of_an_empty_batch():
    assert uniform([], [], 5).shape == (0,)
