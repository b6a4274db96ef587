"""The bend at 128 concurrent requests (co-located paper profile), from a per-step trace.

benchmarks/scaling.py sets the large model's B from the step-aligned chain on the profile's
latencies (no runtime costs), which gives B = 45 at N = 128. This runs N requests in closed loops at
a few B (that one among them) with the step trace on, and prints per run: steady throughput, its
share of the zero-wait bound, the simulator's prediction with the runtime's costs
(tokenrouter/planner/sim.py), and what the trace says the time went to: the large model's mean
batch, step and catch-up tokens per request, the share of time the large model runs (the small
model is frozen then, co-located), and the small model's batch. Each B runs twice: with each
model's max_running_requests at 64, as benchmarks/ablation.py's group had it (and scaling.py with
it), and at 256.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bend128.py --profile profiles/paper_qwen3_0.6b_32b_a100.json \\
        --runtime docs/bench/runtime_cal.json --b 16,32,45
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from tokenrouter import SamplingParams
from tokenrouter.bench.trace_reader import latency_ratio, read_trace
from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.engine.step_trace import ENV as TRACE_ENV
from tokenrouter.models.random_model import build_random_model
from tokenrouter.planner import throughput_curve, zero_wait_bound
from tokenrouter.planner.sim import simulate
from tokenrouter.runtime.entry.entry import Entry

sys.path.insert(0, os.path.dirname(__file__))
from ablation import closed_loop, group, latencies, load_overheads, prompts_for  # noqa: E402
from b_misset import planner_pick  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--b", default="16,32,45")
    ap.add_argument("--max-running", default="64,256",
                    help="each model's max_running_requests, one group each (64: as scaling.py had it)")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--runtime", default=None)
    ap.add_argument("--sim-steps", type=int, default=6000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    profile = LatencyProfile.load(args.profile)
    alpha = profile.interference.get("small", {}).get("large", 0.0)
    lat_s, lat_l = latencies(profile)
    overheads = load_overheads(profile, args.runtime)
    n, p = args.n, args.p
    aligned_b = planner_pick(throughput_curve(n, p, lat_s, lat_l, alpha))  # best_thresholds' rule, at N alone
    bound = zero_wait_bound(n, p, lat_s, lat_l)
    print(f"N = {n}, p = {p}, alpha = {alpha}: aligned chain's B = {aligned_b} (scaling.py's); zero-wait bound "
          f"{bound:.0f} tok/s", flush=True)
    path = str(build_random_model(os.path.join(tempfile.mkdtemp(), "m"), "llama", "tiny", seed=0))
    trace_dir = tempfile.mkdtemp(prefix="steptrace-")
    os.environ[TRACE_ENV] = trace_dir
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for cap in [int(v) for v in args.max_running.split(",")]:
        entry = Entry(group(path, profile.to_dict(), p, {"policy": "eager"}, alpha, max_running=cap))
        try:
            for b in [int(v) for v in args.b.split(",")]:
                t0 = time.perf_counter()
                res = closed_loop(entry, n, b, prompts_for(args.waves * n), params)
                lo, hi = res.steady_window
                steps = read_trace(trace_dir, lo, hi)
                big = [s for s in steps if s.model == 1]
                small = [s for s in steps if s.model == 0]
                span = hi - lo
                sim = simulate(n, b, lat_s, lat_l, alpha, p=p, overheads=overheads, s_steps=args.sim_steps)
                row = {"max_running": cap, "b": b, "steady": res.steady_throughput,
                       "share_of_bound": res.steady_throughput / bound, "sim": sim.throughput, "sim_stderr": sim.stderr,
                       "l_batch": float(np.mean([len(s.rids) for s in big])),
                       "l_step_ms": 1000 * float(np.mean([s.end - s.start for s in big])),
                       "l_catchup": float(np.mean([sum(s.extend_lens) / len(s.rids) for s in big])),
                       "l_busy": sum(s.end - s.start for s in big) / span,
                       "s_batch": float(np.mean([len(s.rids) for s in small])),
                       "s_batch_max": max(len(s.rids) for s in small),
                       "s_ratio": latency_ratio(steps, 0, profile.models["small"], apart_from=1),
                       "l_ratio": latency_ratio(steps, 1, profile.models["large"]),
                       "seconds": time.perf_counter() - t0}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            entry.close()
    print("\n| max running | B | steady tok/s | share of bound | simulated (runtime costs) | large: mean batch, step "
          "ms, catch-up tokens | large busy (small frozen) | small batch mean / max | step latency ratio S / L |")
    print("|---:|---:|---:|---:|---|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['max_running']} | {r['b']} | {r['steady']:.0f} | {100 * r['share_of_bound']:.1f}% | "
              f"{r['sim']:.0f} +- {r['sim_stderr']:.0f} | "
              f"{r['l_batch']:.1f}, {r['l_step_ms']:.1f}, {r['l_catchup']:.1f} | {100 * r['l_busy']:.0f}% | "
              f"{r['s_batch']:.1f} / {r['s_batch_max']} | {r['s_ratio']:.3f} / {r['l_ratio']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"n": n, "p": p, "aligned_b": aligned_b, "bound": bound, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
