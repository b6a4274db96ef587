"""The planner for three models (the ensemble, one launch threshold per model) against measurement.

A three-model group on the latency-model executor (a small, a medium and a large model: 12 ms;
18 ms + 0.2 ms per sequence; 26 ms + 0.4 ms per sequence, as the paper profile's pair with one
model between), the ensemble router at the paper's weights 0.5 / 0.3 / 0.2, co-located (a larger
model's step stops a smaller one's: interference 1 from every larger model) or on separate devices.
For each threshold vector (B_small, B_medium, B_large) the group simulator of
tokenrouter/planner/group_sim.py predicts the throughput, with the runtime's per-step overhead
and hand-off latency from a calibration and the profile's per-token catch-up cost; the planner's
vector is the deadlock-free one of fewest waiting within 1 % of the best predicted. Measured:
steady-state throughput of a closed loop at each of a few vectors, the planner's among them.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ensemble_check.py --runtime docs/bench/runtime_cal.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from tokenrouter import SamplingParams
from tokenrouter.bench.offline import run_closed_loop
from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.models.random_model import build_random_model
from tokenrouter.planner.group_sim import best_group_thresholds, simulate_group
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import SetThresholds

sys.path.insert(0, os.path.dirname(__file__))
from ablation import prompts_for  # noqa: E402

NAMES = ("small", "medium", "large")
MODELS = {"small": {"base": 0.012, "per_seq": 0.0, "per_token": 0.00002},
          "medium": {"base": 0.018, "per_seq": 0.0002, "per_token": 0.0001},
          "large": {"base": 0.026, "per_seq": 0.0004, "per_token": 0.0002}}
WEIGHTS = (0.5, 0.3, 0.2)


def profile(colocated: bool) -> dict:
    inter = {"small": {"medium": 1.0, "large": 1.0}, "medium": {"large": 1.0}} if colocated else {}
    return {"models": MODELS, "interference": inter,
            "notes": "three-model ensemble check (benchmarks/ensemble_check.py)"}


def alpha_matrix(colocated: bool) -> list[list[float]]:
    return [[0, 1, 1], [0, 0, 1], [0, 0, 0]] if colocated else [[0.0] * 3 for _ in range(3)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--placement", default="co-located", choices=["co-located", "separate"])
    ap.add_argument("--b-max", type=int, default=4, help="the planner searches B_m <= this")
    ap.add_argument("--measure", default="1-1-1,1-2-2,2-2-2,1-3-3,1-2-4",
                    help="threshold vectors to measure besides the planner's (small-medium-large)")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--runtime", default=None, help="calibration JSON (benchmarks/ablation.py --calibrate)")
    ap.add_argument("--sim-tokens", type=int, default=20_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    colocated = args.placement == "co-located"
    cal = json.loads(open(args.runtime).read()) if args.runtime else {}
    prof = LatencyProfile.from_dict(profile(colocated))
    lats = [(lambda b, m=m: prof.models[m](b, b)) for m in NAMES]
    kw = dict(token_cost=[MODELS[m]["per_token"] for m in NAMES],
              overhead=[cal.get("s_step_gap", 0.0)] * 3, handoff=cal.get("handoff", 0.0), tokens=args.sim_tokens)
    n = args.n
    choice, results = best_group_thresholds(n, lats, WEIGHTS, alpha_matrix(colocated), b_max=args.b_max, **kw)
    predicted = {r.thresholds: r for r in results}
    best_pred = max(results, key=lambda r: r.throughput)
    print(f"{args.placement}, N = {n}: planner's thresholds {choice} ({predicted[choice].throughput:.1f} tok/s "
          f"predicted); best predicted {best_pred.thresholds} ({best_pred.throughput:.1f}); "
          f"{len(results)} deadlock-free vectors searched", flush=True)
    vectors = [tuple(int(x) for x in v.split("-")) for v in args.measure.split(",")]
    vectors = list(dict.fromkeys([*vectors, choice]))
    path = str(build_random_model(os.path.join(tempfile.mkdtemp(), "m"), "llama", "tiny", seed=0))
    group = GroupConfig.from_dict({
        "models": [{"name": m, "path": path, "kv_cache_tokens": 1 << 16, "max_running_requests": 64} for m in NAMES],
        "algorithm": {"name": "ensemble", "weights": list(WEIGHTS)}, "launch": {"policy": "eager"},
        "executor": {"mode": "latency", "profile": profile(colocated)}})
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    entry = Entry(group)
    try:
        for v in vectors:
            for m, b in zip(NAMES, v):
                entry.pool.send(m, SetThresholds({n: b}))  # B below N: eager (the closed loop's tail)
            res = run_closed_loop(entry, prompts_for(args.waves * n), params, concurrency=n, seed=1)
            pred = predicted.get(v) or simulate_group(n, v, lats, WEIGHTS, alpha_matrix(colocated), **kw)
            rows.append({"thresholds": list(v), "measured": res.steady_throughput, "predicted": pred.throughput,
                         "stderr": pred.stderr, "planner": v == choice, "tokens_per_model": res.tokens_per_model})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        entry.close()
    best = max(rows, key=lambda r: r["measured"])
    mine = next(r for r in rows if r["planner"])
    print("\n| thresholds (S, M, L) | measured tok/s | predicted (error) |")
    print("|---|---:|---|")
    for r in rows:
        tag = " (planner's)" if r["planner"] else ""
        print(f"| {tuple(r['thresholds'])}{tag} | {r['measured']:.1f} | {r['predicted']:.1f} +- {r['stderr']:.1f} "
              f"({100 * (r['predicted'] / r['measured'] - 1):+.1f}%) |")
    print(f"\nplanner's {tuple(mine['thresholds'])}: {mine['measured']:.1f} tok/s measured, "
          f"{100 * (mine['measured'] / best['measured'] - 1):+.1f}% against the best measured "
          f"{tuple(best['thresholds'])} "
          f"({best['measured']:.1f})")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"placement": args.placement, "n": n, "choice": list(choice), "rows": rows}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
