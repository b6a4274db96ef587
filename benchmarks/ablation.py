"""The paper's ablation on the latency-model executor, and the planner checked against it.

Ablation: step-synchronous -> asynchronous (B = 1) -> asynchronous + delayed batching (the planner's
B), with throughput, per-user speed and the share of the zero-wait bound N / (t_S + p t_L):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ablation.py --profile profiles/paper_qwen3_0.6b_32b_a100.json

Planner check, in three steps (measuring is slow, reporting is not):

    ... ablation.py --profile P --calibrate --out cal.json        # the runtime's own costs, from a trace
    ... ablation.py --profile P --grid --n 4,8,16 --p 0.05,0.1,0.2 --interference 0,1 --out grid.jsonl
    ... ablation.py --profile P --report grid.jsonl --runtime cal.json   # prediction vs measurement

Throughput is measured in the closed loop's steady state (OfflineResult.steady_throughput: exactly N
requests live, after a warm-up), which is what the model describes; the whole-run figure, which
also holds the drain at the end, is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from tokenrouter import SamplingParams
from tokenrouter.bench.baselines.step_sync import run_step_sync
from tokenrouter.bench.offline import OfflineResult, run_closed_loop
from tokenrouter.bench.trace_reader import read_trace, runtime_costs
from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.latency_model import LatencyModelRunner, LatencyProfile
from tokenrouter.engine.step_trace import ENV as TRACE_ENV
from tokenrouter.models.random_model import build_random_model
from tokenrouter.planner import Overheads, best_thresholds, throughput_curve, zero_wait_bound
from tokenrouter.routing import make_algorithm
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import SetThresholds


def group(path: str, profile: dict, p: float, launch: dict, interference: float,
          max_running: int = 64) -> GroupConfig:
    """The bernoulli pair on the latency executor. `max_running`: each model's max_running_requests
    (a concurrency above it queues requests at the small model: keep it >= the concurrency)."""
    prof = {**profile, "interference": {"small": {"large": interference}}}
    kv = max(1 << 16, 512 * max_running)
    return GroupConfig.from_dict({
        "models": [{"name": "small", "path": path, "kv_cache_tokens": kv, "max_running_requests": max_running},
                   {"name": "large", "path": path, "kv_cache_tokens": kv, "max_running_requests": max_running}],
        "algorithm": {"name": "bernoulli", "p": p}, "launch": {**launch, "look_ahead": False},  # the models plan none
        "executor": {"mode": "latency", "profile": prof}})


def closed_loop(entry: Entry, n: int, b: int, prompts, params) -> OfflineResult:
    """One closed-loop run at concurrency n with the large model's threshold B = b. The threshold goes
    to the running subserver (as the entry's online planner sends it), so one group serves many runs.
    It holds for every live count (capped at the count): a table keyed at n alone would launch eagerly
    whenever a finish dips the count below n before the next admission."""
    entry.pool.send("large", SetThresholds({1: b}))
    return run_closed_loop(entry, prompts, params, concurrency=n, seed=1)


def run_sync(path: str, profile: LatencyProfile, p: float, n: int, prompts, params):
    engines = {}
    for name in ("small", "large"):
        runner = LatencyModelRunner.for_model(profile, name, path)
        engines[name] = Engine(EngineConfig(model_path=path, kv_cache_tokens=1 << 16, max_running_requests=64),
                               latency_runner=runner)
    router = make_algorithm("bernoulli", ["small", "large"], {"p": p})
    return run_step_sync(engines["small"], engines["large"], router, prompts, params, concurrency=n, seed=1)


def latencies(profile: LatencyProfile):
    """The profile's step latency of each model at one token per request (the planner adds the
    catch-up tokens a hand-off brings, see tokenrouter.planner.overheads)."""
    return (lambda b: profile.models["small"](b, b)), (lambda b: profile.models["large"](b, b))


def load_overheads(profile: LatencyProfile, path: str | None) -> Overheads:
    """The runtime's costs: per-token costs from the profile, overheads from a calibration file."""
    cal = json.loads(open(path).read()) if path else {}
    return Overheads(s_token=profile.models["small"].per_token, l_token=profile.models["large"].per_token,
                   s_overhead=cal.get("s_step_gap", 0.0), l_overhead=cal.get("l_step_gap", 0.0),
                   handoff=cal.get("handoff", 0.0))


def prompts_for(count: int) -> list[list[int]]:
    return [[1 + (i % 200), 2, 3, 4] for i in range(count)]


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",")]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def b_values(n: int, spec: str) -> list[int]:
    """'all' = 1..N; 'sub' = 1..N for N <= 8, else 1-6, then every other up to N (time)."""
    if spec == "all" or n <= 8:
        return list(range(1, n + 1))
    if spec == "sub":
        return sorted({*range(1, 7), *range(8, n + 1, 2)})
    return [b for b in _ints(spec) if b <= n]


def cmd_calibrate(args, path: str, prof_dict: dict) -> int:
    """One traced run (N, p, interference 0, B = 1): the runtime's per-step gaps and hand-off latency."""
    trace_dir = tempfile.mkdtemp(prefix="steptrace-")
    os.environ[TRACE_ENV] = trace_dir
    n, p = _ints(args.n)[0], _floats(args.p)[0]
    entry = Entry(group(path, prof_dict, p, {"policy": "eager"}, 0.0))
    try:
        t0 = time.perf_counter()
        res = closed_loop(entry, n, 1, prompts_for(args.waves * n), SamplingParams(max_tokens=args.max_tokens,
                                                                                           ignore_eos=True))
        t1 = time.perf_counter()
    finally:
        entry.close()
    costs = runtime_costs(read_trace(trace_dir, t0, t1))
    out = {**costs.to_dict(), "n": n, "p": p, "interference": 0.0, "b": 1, "throughput": res.throughput,
           "steady_throughput": res.steady_throughput}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def cmd_grid(args, path: str, prof_dict: dict) -> int:
    """Measure every (interference, p, N, B) of the grid; one group per (interference, p)."""
    trace_dir = tempfile.mkdtemp(prefix="steptrace-")
    os.environ[TRACE_ENV] = trace_dir
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for alpha in _floats(args.interference):
        for p in _floats(args.p):
            entry = Entry(group(path, prof_dict, p, {"policy": "eager"}, alpha))
            try:
                for n in _ints(args.n):
                    for b in b_values(n, args.b):
                        t0 = time.perf_counter()
                        res = closed_loop(entry, n, b, prompts_for(args.waves * n), params)
                        t1 = time.perf_counter()
                        costs = runtime_costs(read_trace(trace_dir, t0, t1))
                        row = {"n": n, "p": p, "alpha": alpha, "b": b, "throughput": res.throughput,
                               "steady_throughput": res.steady_throughput, "per_user": res.mean_per_user,
                               "steady_seconds": res.steady_window[1] - res.steady_window[0],
                               "costs": costs.to_dict()}
                        print(json.dumps(row), flush=True)
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(row) + "\n")
            finally:
                entry.close()
    return 0


def own_gaps_prediction(row: dict, n: int, p: float, alpha: float, lat_s, lat_l, overheads: Overheads) -> float:
    """The prediction for one measured run with the per-step gaps measured in that run (the machine
    is shared, so the runtime's overhead drifts between runs); hand-off latency from the calibration."""
    c = row["costs"]
    own = Overheads(s_token=overheads.s_token, l_token=overheads.l_token,
                    s_overhead=c["s_step_gap"] or overheads.s_overhead,
                    l_overhead=c["l_step_gap"] or overheads.l_overhead, handoff=overheads.handoff)
    return float(throughput_curve(n, p, lat_s, lat_l, alpha, overheads=own)[row["b"] - 1])


def cmd_report(args, profile: LatencyProfile) -> int:
    """Prediction (with and without the runtime's costs) against the measured grid, as markdown."""
    rows = [json.loads(line) for line in open(args.report) if line.strip()]
    overheads = load_overheads(profile, args.runtime)
    lat_s, lat_l = latencies(profile)
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["alpha"], r["p"], r["n"]), []).append(r)
    print(f"overheads: {overheads}")
    print("| placement | p | N | B measured | error range (B) | mean abs error | error, run's own gaps | "
          "old chain error | planner's B | measured best B | planner's B within 3% |")
    print("|---|---:|---:|---|---|---:|---|---|---:|---:|---|")
    worst = 0.0
    for (alpha, p, n), rs in sorted(cells.items()):
        rs.sort(key=lambda r: r["b"])
        bs = [r["b"] for r in rs]
        meas = [r["steady_throughput"] for r in rs]
        new = throughput_curve(n, p, lat_s, lat_l, alpha, overheads=overheads)
        old = throughput_curve(n, p, lat_s, lat_l, alpha)
        err = [(new[b - 1] - m) / m for b, m in zip(bs, meas)]
        err_old = [(old[b - 1] - m) / m for b, m in zip(bs, meas)]
        own = [own_gaps_prediction(r, n, p, alpha, lat_s, lat_l, overheads) for r in rs]
        err_own = [(o - m) / m for o, m in zip(own, meas)]
        worst = max(worst, max(abs(e) for e in err))
        planner_b = best_thresholds(n, p, lat_s, lat_l, alpha, overheads=overheads, min_gain=0.01)[n]
        best_i = max(range(len(bs)), key=lambda i: meas[i])
        at_planner = meas[bs.index(planner_b)] if planner_b in bs else float("nan")
        within = at_planner >= 0.97 * meas[best_i]
        lo, hi = min(range(len(err)), key=lambda i: err[i]), max(range(len(err)), key=lambda i: err[i])
        place = "separate" if alpha == 0 else "co-located" if alpha == 1 else f"alpha {alpha:g}"
        print(f"| {place} | {p:g} | {n} | {','.join(map(str, bs)) if len(bs) < n else '1..' + str(n)} | "
              f"{100 * err[lo]:+.1f}% ({bs[lo]}) to {100 * err[hi]:+.1f}% ({bs[hi]}) | "
              f"{100 * sum(abs(e) for e in err) / len(err):.1f}% | "
              f"{100 * min(err_own):+.1f}% to {100 * max(err_own):+.1f}% | "
              f"{100 * min(err_old):+.1f}% to {100 * max(err_old):+.1f}% | {planner_b} | {bs[best_i]} | "
              f"{'yes' if within else 'no'} ({100 * (at_planner / meas[best_i] - 1):+.1f}%) |")
    print(f"\nlargest |error|: {100 * worst:.1f}%")
    if args.verbose:
        for (alpha, p, n), rs in sorted(cells.items()):
            new = throughput_curve(n, p, lat_s, lat_l, alpha, overheads=overheads)
            print(f"alpha={alpha:g} p={p:g} N={n}: " + ", ".join(
                f"{r['b']}: {new[r['b'] - 1]:.1f}/{r['steady_throughput']:.1f}" for r in rs))
    return 0


def cmd_ablation(args, path: str, profile: LatencyProfile, prof_dict: dict) -> int:
    n, p = _ints(args.n)[0], _floats(args.p)[0]
    alpha = _floats(args.interference)[0] if args.interference else profile.interference.get("small", {}).get(
        "large", 0.0)
    lat_s, lat_l = latencies(profile)
    overheads = load_overheads(profile, args.runtime)
    prompts = prompts_for(args.waves * n)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    bound = zero_wait_bound(n, p, lat_s, lat_l)
    planner_b = best_thresholds(n, p, lat_s, lat_l, alpha, overheads=overheads, min_gain=0.01)[n]
    rows = []

    def report(name: str, thr: float, steady: float | None, per_user: float) -> None:
        rows.append({"system": name, "n": n, "p": p, "alpha": alpha, "throughput": thr, "steady_throughput": steady,
                     "per_user": per_user, "share_of_bound": thr / bound})
        st = f"steady {steady:7.1f} ({100 * steady / bound:5.1f}%)" if steady else ""
        print(f"{name:34s} {thr:7.1f} tok/s ({100 * thr / bound:5.1f}% of bound)  {st}  per-user {per_user:6.1f}",
              flush=True)

    print(f"profile {args.profile}: N={n} p={p} alpha={alpha}; zero-wait bound {bound:.1f} tok/s; "
          f"planner's B({n}) = {planner_b}; overheads {overheads}", flush=True)
    sync = run_sync(path, profile, p, n, prompts, params)
    report("step-synchronous", sync.throughput, None, sum(sync.per_user) / len(sync.per_user))
    entry = Entry(group(path, prof_dict, p, {"policy": "eager"}, alpha))
    try:
        for b, name in ((1, "asynchronous (B=1)"), (planner_b, f"asynchronous + delayed (B={planner_b})")):
            res = closed_loop(entry, n, b, prompts, params)
            report(name, res.throughput, res.steady_throughput, res.mean_per_user)
    finally:
        entry.close()
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({"profile": args.profile, **row}) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--n", default="8", help="concurrency (a list for --grid)")
    ap.add_argument("--p", default="0.1", help="routing probability, bernoulli (a list for --grid)")
    ap.add_argument("--interference", default=None,
                    help="alpha of L on S, overriding the profile's (a list for --grid)")
    ap.add_argument("--b", default="all", help="--grid: thresholds B, 'all', 'sub' (N > 8: 1-6 then even) or a list")
    ap.add_argument("--waves", type=int, default=2, help="requests per run: this many times N")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--runtime", default=None, help="calibration JSON from --calibrate (the runtime's overheads)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--calibrate", action="store_true", help="measure the runtime's overheads from a step trace")
    mode.add_argument("--grid", action="store_true", help="measure every B of every (N, p, interference)")
    mode.add_argument("--report", default=None, help="JSON lines from --grid: compare with the planner")
    ap.add_argument("--verbose", action="store_true", help="--report: every B's prediction/measurement")
    ap.add_argument("--out", default=None, help="write (calibrate) or append (grid, ablation) JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    profile = LatencyProfile.load(args.profile)
    if args.report:
        return cmd_report(args, profile)
    path = str(build_random_model(os.path.join(tempfile.mkdtemp(), "m"), "llama", "tiny", seed=0))
    prof_dict = profile.to_dict()
    if args.calibrate:
        return cmd_calibrate(args, path, prof_dict)
    if args.grid:
        if args.interference is None:
            ap.error("--grid needs --interference")
        return cmd_grid(args, path, prof_dict)
    return cmd_ablation(args, path, profile, prof_dict)


if __name__ == "__main__":
    sys.exit(main())
