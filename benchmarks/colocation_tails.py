"""Co-location tails: p50/p99 inter-token latency (ITL) and time to first token (TTFT), separate
devices against co-located, measured on the latency-model executor (paper profile, bernoulli p),
with the interference model's prediction beside (the simulator of tokenrouter/planner/sim.py, which
runs the same system with the runtime's costs and records each request's gaps between tokens), and
what the planner's SLO option (tokenrouter/planner/slo.py) picks under a p99 ITL bound.

ITL and TTFT are taken as the entry hands tokens out (no HTTP): ITL is every gap between two tokens
of one request, TTFT from admission to the first token. The simulator has no prefill and no
admission (a closed system), so it predicts ITL only.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/colocation_tails.py \\
        --profile profiles/paper_qwen3_0.6b_32b_a100.json --runtime docs/bench/runtime_cal.json --itl-p99 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

from tokenrouter import SamplingParams
from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.models.random_model import build_random_model
from tokenrouter.planner import throughput_curve
from tokenrouter.planner.sim import simulate
from tokenrouter.planner.slo import slo_threshold
from tokenrouter.runtime.entry.entry import Entry

sys.path.insert(0, os.path.dirname(__file__))
from ablation import closed_loop, group, latencies, load_overheads, prompts_for  # noqa: E402
from b_misset import around, place, planner_pick  # noqa: E402


def ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--n", default="8,32")
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--interference", default="0,1")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--runtime", default=None, help="calibration JSON (benchmarks/ablation.py --calibrate)")
    ap.add_argument("--itl-p99", type=float, default=0.1, help="the SLO: p99 inter-token latency bound, seconds")
    ap.add_argument("--sim-steps", type=int, default=20_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    profile = LatencyProfile.load(args.profile)
    lat_s, lat_l = latencies(profile)
    overheads = load_overheads(profile, args.runtime)
    path = str(build_random_model(os.path.join(tempfile.mkdtemp(), "m"), "llama", "tiny", seed=0))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    p = args.p
    rows = []
    for alpha in [float(a) for a in args.interference.split(",")]:
        entry = Entry(group(path, profile.to_dict(), p, {"policy": "eager"}, alpha))
        try:
            for n in [int(v) for v in args.n.split(",")]:
                curve = throughput_curve(n, p, lat_s, lat_l, alpha, overheads=overheads)
                planner_b = planner_pick(curve)
                cands = around(planner_b, n)
                slo = slo_threshold(n, lat_s, lat_l, alpha, itl_p99_max=args.itl_p99, p=p, overheads=overheads,
                                    b_values=cands, s_steps=args.sim_steps)
                for b in sorted({1, planner_b, slo.b}):
                    res = closed_loop(entry, n, b, prompts_for(args.waves * n), params)
                    sim = simulate(n, b, lat_s, lat_l, alpha, p=p, overheads=overheads, s_steps=args.sim_steps)
                    row = {"alpha": alpha, "n": n, "b": b, "planner_b": planner_b, "slo_b": slo.b,
                           "slo_feasible": slo.feasible, "steady": res.steady_throughput,
                           "itl_p50": float(np.percentile(res.itl, 50)), "itl_p99": float(np.percentile(res.itl, 99)),
                           "ttft_p50": float(np.percentile(res.ttft, 50)),
                           "ttft_p99": float(np.percentile(res.ttft, 99)),
                           "sim_throughput": sim.throughput, "sim_itl_p50": sim.itl_percentile(50),
                           "sim_itl_p99": sim.itl_percentile(99), "chain": float(curve[b - 1])}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            entry.close()
    print(f"\np = {p}; SLO: p99 ITL <= {ms(args.itl_p99)} ms; ms throughout")
    print("| placement | N | B | which | steady tok/s (chain) | ITL p50 measured / sim | ITL p99 measured / sim "
          "| TTFT p50 | TTFT p99 |")
    print("|---|---:|---:|---|---|---|---|---:|---:|")
    for r in rows:
        which = ", ".join(w for w, hit in (("eager", r["b"] == 1), ("planner", r["b"] == r["planner_b"]),
                                            ("SLO" + ("" if r["slo_feasible"] else " (infeasible)"),
                                             r["b"] == r["slo_b"])) if hit)
        print(f"| {place(r['alpha'])} | {r['n']} | {r['b']} | {which} | {r['steady']:.0f} ({r['chain']:.0f}) | "
              f"{ms(r['itl_p50'])} / {ms(r['sim_itl_p50'])} | {ms(r['itl_p99'])} / {ms(r['sim_itl_p99'])} | "
              f"{ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
