"""Decode-step cost of models against each other, in our engine.

All engines live in the calling process on its torch threads; their decode steps are timed in
alternating rounds (a, b, c, a, b, c, ...) so that whatever else runs on the machine weighs on all
alike, and each (model, batch size) gets the median over rounds of its median step time.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.profiler import decode_seconds


def decode_costs(models: Mapping[str, str | Path], batch_sizes: Sequence[int], context: int = 128,
                 steps: int = 20, rounds: int = 5) -> dict[tuple[str, int], float]:
    """{(model name, batch size): seconds per decode step} at `context` tokens of context."""
    engines = {name: Engine(EngineConfig(model_path=str(path), max_running_requests=max(batch_sizes)))
               for name, path in models.items()}
    try:
        for e in engines.values():
            decode_seconds(e, 1, context, 3)  # warm-up
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(rounds):
            for b in batch_sizes:
                for name, e in engines.items():
                    times.setdefault((name, b), []).append(decode_seconds(e, b, context, steps))
    finally:
        for e in engines.values():
            e.shutdown()
    return {key: statistics.median(ts) for key, ts in times.items()}
