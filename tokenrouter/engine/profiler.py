"""Measure a model's step latency on this machine, for the planner and the latency-model executor.

Decode steps are timed at several batch sizes with a fixed context; the prefill cost per token is
the slope between two prefill lengths. The result is a `StepLatency` (a table over batch sizes plus
a per-token term), written into a latency profile.
"""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine, EngineStats
from tokenrouter.engine.latency_model import StepLatency
from tokenrouter.sampling_params import SamplingParams

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)


def decode_seconds(engine: Engine, batch: int, context: int, steps: int) -> float:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % vocab for j in range(context)], params)
    while any(r.kv_len < r.prompt_len for r in engine.reqs.values()):
        engine.step()  # prefill, untimed
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_all()
    engine.cache.reset()
    return statistics.median(times)


def _prefill_seconds(engine: Engine, length: int, repeats: int = 3) -> float:
    vocab = engine.model_config.vocab_size
    times = []
    for k in range(repeats):
        engine.add_request([(11 * j + k) % vocab for j in range(length)], SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
        engine.cache.reset()
    return statistics.median(times)


def measure(model_path: str, batches: tuple[int, ...] = DEFAULT_BATCHES, context: int = 128, steps: int = 10,
            prefill: tuple[int, int] = (64, 512), **engine_kwargs: object) -> StepLatency:
    kw: dict[str, object] = {"max_running_requests": max(batches), "chunked_prefill_size": max(2048, prefill[1]),
                             **engine_kwargs}
    engine = Engine(EngineConfig(model_path=model_path, **kw))  # type: ignore[arg-type]
    return measure_engine(engine, batches, context, steps, prefill)


def measure_engine(engine: Engine, batches: tuple[int, ...] = DEFAULT_BATCHES, context: int = 128, steps: int = 10,
                   prefill: tuple[int, int] = (64, 512), progress: bool = True) -> StepLatency:
    """Measure on an idle engine (its requests are dropped, its prefix cache and counters reset after)."""
    batches = tuple(b for b in batches if b <= engine.cfg.max_running_requests) or (1,)
    longest = min(prefill[1], engine.max_model_len - 2)
    prefill = (min(prefill[0], longest // 2), longest)
    decode_seconds(engine, 1, context, 3)  # warm-up: first allocations are slow
    table = []
    for b in tqdm(batches, desc="decode steps", unit="batch", disable=not progress):
        table.append((b, decode_seconds(engine, b, context, steps)))
    short, long = (_prefill_seconds(engine, n) for n in prefill)
    per_token = max(0.0, (long - short) / (prefill[1] - prefill[0]))
    engine.stats = EngineStats()
    return StepLatency(per_token=per_token, table=tuple(table))
