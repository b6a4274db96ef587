"""What a mis-set delayed-batching threshold B costs, and the online re-plan when the share drifts.

Sweep (default): for each placement, routing probability p and concurrency N, the continuous-time
chain's throughput for every B (tokenrouter/planner/continuous.py, with the runtime's costs from a
calibration) and the measured steady-state throughput at a few B around the planner's choice
(the latency-model executor, paper profile, bernoulli router). Prints, per cell, the planner's B,
the measured best B, and each measured B's loss against the best measured; plots throughput
against B (PNG).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/b_misset.py --profile profiles/paper_qwen3_0.6b_32b_a100.json \\
        --runtime docs/bench/runtime_cal.json --interference 1 --plot docs/bench/b_misset_coloc.png

Drift (--drift): a closed loop whose share changes half-way (the first half of the requests route
with p = --p-before, the second with --p-after, per request), run with fixed thresholds B (the same
table for every live count) and with the online planner (launch policy `planner`, which estimates p
from the tokens it sees and re-plans, tokenrouter/planner/controller.py), once with its estimate over
every token since the start and once with a memory of --windows tokens. Prints each run's whole-run
throughput and the planner's loss against the best fixed B.

    ... b_misset.py --profile P --drift --n 8 --interference 1 --b 1,2,3,4,5,6
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
from tokenrouter.bench.offline import run_closed_loop
from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.models.random_model import build_random_model
from tokenrouter.planner import throughput_curve
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.messages import SetThresholds

sys.path.insert(0, os.path.dirname(__file__))
from ablation import closed_loop, group, latencies, load_overheads, prompts_for  # noqa: E402


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",")]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def around(best: int, n: int) -> list[int]:
    """B = 1, half the planner's, the planner's and its double (the mis-set candidates)."""
    return sorted({1, max(1, best // 2), best, min(n, 2 * best)})


def place(alpha: float) -> str:
    return "separate" if alpha == 0 else "co-located" if alpha == 1 else f"alpha {alpha:g}"


def sweep(args, path: str, profile: LatencyProfile) -> int:
    lat_s, lat_l = latencies(profile)
    overheads = load_overheads(profile, args.runtime)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    cells = []
    for alpha in _floats(args.interference):
        for p in _floats(args.p):
            entry = Entry(group(path, profile.to_dict(), p, {"policy": "eager"}, alpha))
            try:
                for n in _ints(args.n):
                    t0 = time.perf_counter()
                    curve = throughput_curve(n, p, lat_s, lat_l, alpha, overheads=overheads)
                    solve_s = time.perf_counter() - t0
                    planner_b = planner_pick(curve)
                    meas = {}
                    for b in around(planner_b, n):
                        res = closed_loop(entry, n, b, prompts_for(args.waves * n), params)
                        meas[b] = res.steady_throughput
                        print(f"{place(alpha)} p={p:g} N={n} B={b}: {res.steady_throughput:.1f} tok/s "
                              f"(predicted {curve[b - 1]:.1f})", flush=True)
                    cells.append({"alpha": alpha, "p": p, "n": n, "planner_b": planner_b, "curve": curve.tolist(),
                                  "measured": meas, "solve_s": solve_s})
            finally:
                entry.close()
    print("\n| placement | p | N | planner's B | measured best B | throughput at each measured B "
          "(loss vs best measured) "
          "| predicted loss of B = 1 | loss at planner's B |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for c in cells:
        meas = c["measured"]
        best_b = max(meas, key=meas.get)
        best = meas[best_b]
        curve = np.array(c["curve"])
        cols = ", ".join(f"B={b}: {v:.0f} ({100 * (v / best - 1):+.1f}%)" for b, v in sorted(meas.items()))
        print(f"| {place(c['alpha'])} | {c['p']:g} | {c['n']} | {c['planner_b']} | {best_b} | {cols} | "
              f"{100 * (curve[0] / curve.max() - 1):+.1f}% | {100 * (meas[c['planner_b']] / best - 1):+.1f}% |")
    if args.out:
        with open(args.out, "a") as f:
            for c in cells:
                f.write(json.dumps(c) + "\n")
    if args.plot:
        plot(cells, args.plot)
    return 0


def planner_pick(curve: np.ndarray, min_gain: float = 0.01) -> int:
    """The planner's rule (tokenrouter.planner.chain.best_thresholds): the smallest B within 1% of the best."""
    ok = np.nonzero(curve >= curve.max() / (1.0 + min_gain))[0]
    return int(ok[0]) + 1


def plot(cells: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = sorted({c["p"] for c in cells})
    cols = sorted({(c["alpha"], c["n"]) for c in cells})
    fig, axes = plt.subplots(len(ps), len(cols), figsize=(4.2 * len(cols), 3.2 * len(ps)), squeeze=False)
    for c in cells:
        ax = axes[ps.index(c["p"])][cols.index((c["alpha"], c["n"]))]
        bs = np.arange(1, c["n"] + 1)
        ax.plot(bs, c["curve"], "b-", label="chain (runtime costs)")
        mb = sorted(int(b) for b in c["measured"])
        ax.plot(mb, [c["measured"][b] if b in c["measured"] else c["measured"][str(b)] for b in mb], "ko",
                label="measured")
        ax.axvline(c["planner_b"], color="g", ls="--", label=f"planner's B = {c['planner_b']}")
        ax.set_title(f"{place(c['alpha'])}, p = {c['p']:g}, N = {c['n']}", fontsize=9)
        ax.set_xlabel("B")
        ax.set_ylabel("tok/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


def drift(args, path: str, profile: LatencyProfile) -> int:
    """Fixed B against the online planner when p changes half-way through the requests."""
    n = _ints(args.n)[0]
    alpha = _floats(args.interference)[0]
    count = args.waves * n
    routings = [{"p": args.p_before if i < count // 2 else args.p_after} for i in range(count)]
    prompts = prompts_for(count)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = {}
    prof = profile.to_dict()
    entry = Entry(group(path, prof, args.p_before, {"policy": "eager"}, alpha))
    try:
        for b in _ints(args.b):
            if b > n:
                continue
            entry.pool.send("large", SetThresholds({1: b}))
            res = run_closed_loop(entry, prompts, params, concurrency=n, seed=1, routings=routings)
            rows[f"B={b}"] = res.throughput
            print(f"fixed B={b}: {res.throughput:.1f} tok/s (whole run)", flush=True)
    finally:
        entry.close()
    planner = {"policy": "planner", "alpha": alpha, "p": args.p0, "n_max": n}
    for window in _ints(args.windows):
        entry = Entry(group(path, prof, args.p_before, planner, alpha))
        try:
            entry.planner.window = window or None  # the controller's memory (PlannerController(window=...))
            res = run_closed_loop(entry, prompts, params, concurrency=n, seed=1, routings=routings)
            ctl = entry.planner
            rows[f"planner, window {window or 'none'}"] = res.throughput
            catchup = "none measured" if ctl.catchup is None else f"{ctl.catchup:.2f} tokens a visit"
            print(f"online planner (window {window or 'none'}): {res.throughput:.1f} tok/s; final estimate "
                  f"p = {ctl.estimate[0]:.3f}, catch-up {catchup} (planned with {ctl.catchup_planned}), "
                  f"table {ctl.table}", flush=True)
        finally:
            entry.close()
    best = max((v, k) for k, v in rows.items() if not k.startswith("planner"))
    print(f"\ndrift p {args.p_before} -> {args.p_after}, N = {n}, {place(alpha)}: best fixed {best[1]} "
          f"{best[0]:.1f} tok/s")
    for k, v in rows.items():
        if k.startswith("planner"):
            print(f"online {k}: {v:.1f} tok/s ({100 * (v / best[0] - 1):+.1f}% against the best fixed B)")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"drift": [args.p_before, args.p_after], "n": n, "alpha": alpha, **rows}) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--n", default="8,32")
    ap.add_argument("--p", default="0.05,0.1,0.3")
    ap.add_argument("--interference", default="0,1")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--runtime", default=None, help="calibration JSON (benchmarks/ablation.py --calibrate)")
    ap.add_argument("--drift", action="store_true", help="p changes half-way: fixed B against the online planner")
    ap.add_argument("--p-before", type=float, default=0.05)
    ap.add_argument("--p-after", type=float, default=0.3)
    ap.add_argument("--p0", type=float, default=0.1, help="--drift: the planner's starting p (launch.p)")
    ap.add_argument("--b", default="1,2,3,4,6,8", help="--drift: the fixed thresholds")
    ap.add_argument("--windows", default="0,2000",
                    help="--drift: the planner's memory in tokens, one run each (0: none, every token since the start)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--out", default=None, help="append JSON lines here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    profile = LatencyProfile.load(args.profile)
    path = str(build_random_model(os.path.join(tempfile.mkdtemp(), "m"), "llama", "tiny", seed=0))
    return drift(args, path, profile) if args.drift else sweep(args, path, profile)


if __name__ == "__main__":
    sys.exit(main())
