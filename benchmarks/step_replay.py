"""The large model's steps as served, and the same steps replayed on a quiet machine: how much of a
live step is its make-up (rows, requests, contexts) and how much the machine it shares.

For the large model alone and for the routed group of `--config` (eager), a closed loop keeps N
requests in flight through the entry (held-out arithmetic chat prompts, EOS ignored, as
benchmarks/pair_legs.py runs them) with the step trace on (tokenrouter/engine/step_trace.py). The
large model's steps in the steady window are then replayed, after the group has closed, on a fresh
engine of the large model (its config's engine settings, one thread) in this process: each step's
requests get synthetic ids, pages for their context, and the runner runs exactly the traced new
tokens per request (decodes, catch-ups, prompts) over whatever KV the pages hold (a step's cost does
not depend on its values). A request's context is the sum of what the large model computed for it in
earlier traced steps: a first visit that hit the prefix cache is replayed with a shorter context than
it had, and a visit that rolled back a token (tokenrouter/engine/engine.py `receive`) with a longer
one; its rows are exact.

A live step is the traced span of `Engine.forward_step`, which includes the work a subserver overlaps
with it (sending the previous step's outputs, receiving messages); a replayed one is the runner's
step alone. Each replay runs `--rounds` times quietly and, for the routed group, as many times with
the student beside it in another process (benchmarks/step_interference.py's neighbour, decoding as
many requests a step and busy as large a share as the traced student). Prints, per setup, the live
and replayed milliseconds per step and per row.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_replay.py --config PAIR.yaml --n 8 --requests 48 \\
        --max-tokens 32
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from tokenrouter import SamplingParams
from tokenrouter.bench.offline import run_closed_loop
from tokenrouter.bench.trace_reader import Step, read_trace
from tokenrouter.bench.workloads import build_prompts
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.req import Req, ReqStatus
from tokenrouter.engine.step_trace import ENV as TRACE_ENV
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig

sys.path.insert(0, os.path.dirname(__file__))
from pair_legs import closed_loop_args  # noqa: E402
from runtime_stages import real_group  # noqa: E402
from step_interference import beside  # noqa: E402


def traced_run(config: str, setup: str, prompts: list[list[int]], n: int, max_tokens: int,
               trace: str) -> tuple[list[Step], list[Step], tuple[float, float]]:
    """The large model's steps in the steady window, every traced step of the run (`contexts` reads
    the contexts off them), and the window."""
    cfg = real_group(config, setup)
    if setup == "routed":
        cfg = GroupConfig.from_dict({**cfg.to_dict(), "launch": {"policy": "eager", "look_ahead": False}})
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    entry = Entry(cfg, detokenize=True)
    try:
        run_closed_loop(entry, prompts[:2 * n], params, n)  # warm-up: prefix caches, first steps
        t0 = time.perf_counter()
        res = run_closed_loop(entry, prompts, params, n)
        steps = read_trace(trace, t0, time.perf_counter())
    finally:
        entry.close()
    large = len(cfg.names) - 1
    window = res.steady_window
    if window[1] <= window[0]:
        raise SystemExit(f"{setup}: no steady window; give more --requests than --n")
    return in_window(steps, large, window), steps, window


def contexts(steps: list[Step], large: int) -> dict[int, list[int]]:
    """For each of the large model's steps (by id), each request's context before it: the tokens the
    large model computed for that request in earlier traced steps."""
    done: dict[str, int] = {}
    out: dict[int, list[int]] = {}
    for s in steps:
        if s.model != large:
            continue
        out[id(s)] = [done.get(r, 0) for r in s.rids]
        for r, e in zip(s.rids, s.extend_lens):
            done[r] = done.get(r, 0) + e
    return out


def replay(engine: Engine, steps: list[Step], ctx: dict[int, list[int]]) -> list[float]:
    """Seconds of each step run through the engine's runner, requests built to the traced shape."""
    pool, page = engine.pool, engine.pool.page_size
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: list[float] = []
    for s in steps:
        reqs: list[Req] = []
        for i, (c, e) in enumerate(zip(ctx[id(s)], s.extend_lens)):
            pages = pool.alloc(math.ceil((c + e) / page))
            assert pages is not None, "the replay engine's KV pool is too small"
            reqs.append(Req(rid=f"replay-{i}", tokens=[(7919 * i + 13 * j) % (vocab - 200) + 100 for j in range(c + e)],
                            prompt_len=c + e, params=params, seed=0, status=ReqStatus.RUNNING, kv_len=c,
                            pages=pages))
        t0 = time.perf_counter()
        engine.runner.run(reqs, list(s.extend_lens))
        times.append(time.perf_counter() - t0)
        for r in reqs:
            pool.free(r.pages)
    return times


def in_window(steps: list[Step], model: int, window: tuple[float, float]) -> list[Step]:
    return [s for s in steps if s.model == model and window[0] <= s.start <= window[1]]


def busy(steps: list[Step], model: int, window: tuple[float, float]) -> float:
    """The share of the window `model` spent in steps."""
    return sum(s.end - s.start for s in in_window(steps, model, window)) / (window[1] - window[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    closed_loop_args(ap)
    ap.add_argument("--rounds", type=int, default=3, help="replays of the traced steps, each way")
    args = ap.parse_args()
    torch.set_num_threads(1)
    group = GroupConfig.from_yaml(args.config)
    student, large_spec = group.models[0].engine.model_path, group.models[-1].engine
    prompts, _ = build_prompts("arith", "cpu", args.requests, 0, load_tokenizer(large_spec.model_path))
    ids = [p for p in prompts if isinstance(p, list)]
    if len(ids) != len(prompts):
        raise SystemExit("the arith workload with a tokenizer gives token ids; got text prompts")
    runs: dict[str, tuple[list[Step], list[Step], tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="step-replay-") as trace:
        os.environ[TRACE_ENV] = trace  # before the subservers spawn: they inherit it
        for setup in ("large", "routed"):
            for f in os.listdir(trace):  # each setup reads its own run only
                os.remove(os.path.join(trace, f))
            runs[setup] = traced_run(args.config, setup, ids, args.n, args.max_tokens, trace)
        del os.environ[TRACE_ENV]
    engine = Engine(dataclasses.replace(large_spec, num_threads=1))
    print(f"N = {args.n}, {args.requests} requests of {args.max_tokens} tokens; the large model's steps in each "
          f"steady window, live and replayed ({args.rounds} rounds each way, medians of the rounds' sums)\n")
    print("| setup | replay | steps | rows a step | requests a step | ms a step | ms a row | / live |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for setup, (steps, every, window) in runs.items():
        large = 1 if setup == "routed" else 0
        ctx = contexts(every, large)
        rows = sum(sum(s.extend_lens) for s in steps)
        live = sum(s.end - s.start for s in steps)
        replay(engine, steps[:8], ctx)  # warm-up
        # the student beside the replay decodes as many requests a step, and is as busy, as it was traced
        batch = max(1, round(float(np.mean([len(s.rids) for s in in_window(every, 0, window)] or [1]))))
        sums: dict[str, list[float]] = {"quiet": []}
        for _ in range(args.rounds):
            sums["quiet"].append(sum(replay(engine, steps, ctx)))
            if setup == "routed":
                with beside("student", student, batch, busy(every, 0, window)):
                    sums.setdefault("student beside", []).append(sum(replay(engine, steps, ctx)))
        n, req = len(steps), np.mean([len(s.rids) for s in steps])
        print(f"| {setup} | live | {n} | {rows / n:.1f} | {req:.2f} | {1000 * live / n:.1f} | "
              f"{1000 * live / rows:.2f} | 1.00 |")
        for kind, vals in sums.items():
            t = statistics.median(vals)
            print(f"| {setup} | {kind} (rounds {min(vals) / live:.2f}-{max(vals) / live:.2f}) | {n} | "
                  f"{rows / n:.1f} | {req:.2f} | {1000 * t / n:.1f} | {1000 * t / rows:.2f} | {t / live:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
