"""Where a request's time goes under load: the routed pair against its large model alone, from the trace.

A closed loop keeps N requests in flight (held-out arithmetic chat prompts, as `tokenrouter bench
compare --workload arith` asks them, EOS ignored, `--max-tokens` each) through the entry, once for
the large model alone and once for the routed group of `--config` (each launch rule of `--b`: 1 is
eager, B > 1 delays the large model's steps until B of its requests are ready), with the step trace
on (tokenrouter/engine/step_trace.py). For each run, over its steady window (all N requests live):

- each model's share of the wall time spent in steps (busy), its steps, the rows they computed (each
  request's new tokens: decodes, catch-up, prompts) and the least-squares step cost
  ms = c0 + c1 x rows + c2 x requests, which says whether a model pays per step or per row;
- the mean number of requests in each leg (tokenrouter.planner.sim.LEGS: on S, on its way to L and
  in L's queue, on L, back to S; for the large model alone every request is "on S", its model), and
  by Little's law the milliseconds per request in each;
- for the pair, the large model's look-ahead rows and the returns they answered (engine.py
  Engine.hand_off); `--look-ahead-ab` runs the pair a second time with look-ahead off.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pair_legs.py --config PAIR.yaml --n 8 --requests 48 \\
        --max-tokens 32 --b 1,4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

from tokenrouter import SamplingParams
from tokenrouter.bench.offline import run_closed_loop
from tokenrouter.bench.trace_reader import read_trace, request_legs
from tokenrouter.bench.workloads import build_prompts
from tokenrouter.engine.step_trace import ENV as TRACE_ENV
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.planner.sim import LEGS
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import SetThresholds

sys.path.insert(0, os.path.dirname(__file__))
from runtime_stages import real_group  # noqa: E402
from send_patterns_pair import step_fit  # noqa: E402


def model_rows(steps, names: list[str], window: tuple[float, float]) -> list[str]:
    """One table row per model: busy share, steps, rows, mean batch, the step-cost fit."""
    t0, t1 = window
    out = []
    for m, name in enumerate(names):
        mine = [s for s in steps if s.model == m and t0 <= s.start < t1]
        if not mine:
            continue
        ms = np.array([1000 * (s.end - s.start) for s in mine])
        rows = np.array([s.rows for s in mine], dtype=float)
        reqs = np.array([len(s.rids) + s.ahead for s in mine], dtype=float)
        coef = 1000 * step_fit(mine, lambda s: [1.0, s.rows, len(s.rids) + s.ahead])
        out.append(f"{name}: busy {ms.sum() / 1000 / (t1 - t0):.2f}, {len(mine)} steps, {int(rows.sum())} rows "
                   f"({rows.mean():.1f} a step, {reqs.mean():.2f} requests), {ms.mean():.1f} ms a step "
                   f"= {coef[0]:.1f} + {coef[1]:.2f} x rows + {coef[2]:.2f} x requests")
    return out


def closed_loop_args(ap: argparse.ArgumentParser) -> None:
    """The closed loop's options (the pair's config, requests in flight, requests, tokens each)."""
    ap.add_argument("--config", required=True, help="the routed pair's YAML (small first, large second)")
    ap.add_argument("--n", type=int, default=8, help="requests in flight")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    closed_loop_args(ap)
    ap.add_argument("--b", default="1", help="the large model's launch thresholds to run the pair at")
    ap.add_argument("--look-ahead-ab", action="store_true",
                    help="run the pair again with launch.look_ahead off (engine.py Engine.hand_off)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    trace = tempfile.mkdtemp(prefix="pair-legs-")
    os.environ[TRACE_ENV] = trace  # before the subservers spawn: they inherit it
    tok = load_tokenizer(GroupConfig.from_yaml(args.config).models[-1].engine.model_path)
    prompts, _ = build_prompts("arith", "cpu", args.requests, 0, tok)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    print(f"N = {args.n}, {args.requests} requests of {args.max_tokens} tokens, prompts of "
          f"{np.mean([len(p) for p in prompts]):.1f} ids\n")
    print("| setup | tok/s (steady) | ms per request | " + " | ".join(LEGS) + " | outside |")
    print("|---|---:|---:|" + "---:|" * (len(LEGS) + 1))
    notes = []
    bs = [int(b) for b in args.b.split(",")]
    setups = [("large", [1], True), ("routed", bs, True)] + ([("routed", bs, False)] if args.look_ahead_ab else [])
    for setup, bs, look_ahead in setups:
        cfg = real_group(args.config, setup)
        if setup == "routed":  # each row's B is the one it names: no planner re-sending its own table
            cfg = GroupConfig.from_dict({**cfg.to_dict(), "launch": {"policy": "eager", "look_ahead": look_ahead}})
        entry = Entry(cfg, detokenize=True)
        try:
            run_closed_loop(entry, prompts[:2 * args.n], params, args.n)  # warm-up: prefix caches, first steps
            for b in bs:
                if setup == "routed":
                    entry.pool.send(cfg.names[1], SetThresholds({1: b}))
                before = entry.stats()[cfg.names[-1]]
                t0 = time.perf_counter()
                res = run_closed_loop(entry, prompts, params, args.n)
                after = entry.stats()[cfg.names[-1]]
                window = res.steady_window
                t1 = time.perf_counter()
                steps = read_trace(trace, t0, t1)  # this run's: request ids repeat across entries
                label = setup if setup == "large" else f"routed, B = {b}" + ("" if look_ahead else ", no look-ahead")
                if window[1] <= window[0]:
                    print(f"| {label} | no steady window: give more --requests than --n |", flush=True)
                    continue
                legs = request_legs(read_trace(trace, t0, t1, with_answered=True), *window)
                # Little's law: requests finish at (steady tokens / tokens per request) a second
                per_s = res.steady_throughput / args.max_tokens
                cells = " | ".join(f"{legs[k]:.2f} ({1000 * legs[k] / per_s:.0f} ms)" for k in LEGS)
                print(f"| {label} | {res.steady_throughput:.1f} | {1000 * args.n / per_s:.0f} | {cells} | "
                      f"{args.n - sum(legs.values()):.2f} |", flush=True)
                rows = model_rows(steps, cfg.names, window)
                if setup == "routed":
                    rows.append(f"{cfg.names[-1]}'s look-ahead rows {after.look_aheads - before.look_aheads}, "
                                f"returns answered from them {after.look_ahead_hits - before.look_ahead_hits}, "
                                f"of its {after.handoffs_sent - before.handoffs_sent} hand-backs "
                                "(the whole run)")
                notes.append((label, rows))
        finally:
            entry.close()
    for label, rows in notes:
        print(f"\n{label}:\n- " + "\n- ".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
