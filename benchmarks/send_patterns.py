"""Real send patterns: run lengths between sends, read off the runtime's step trace, against the
throughput chain's geometric assumption; and the planner's error with either.

For each router, the routed runtime on the latency-model executor (paper profile) runs closed loops
at concurrency N for a few thresholds B, on separate devices and co-located, with the step trace on
(tokenrouter/engine/step_trace.py). From the trace: every request's visits and the small model's
run lengths between sends (`send_runs`, censored runs included; both routers draw per request seed
and position, so every run of a router sends alike and the first run's trace is the sample), the
geometric fit and its
goodness of fit (tokenrouter/planner/gaps.py: hazard chi-square, Kaplan-Meier distance). Then, for
each measured run, two predictions against the measured steady-state throughput, both with that
run's own per-step gaps read off its trace (the machine is shared, so the runtime's overhead drifts
between runs) and the calibration's hand-off latency; then both again with the run's own step
latencies (its steps' measured durations over the profile's, `latency_ratio`: a loaded host stretches
the executor's sleeps, which no model of the runtime should be blamed for):

- the continuous-time chain (tokenrouter/planner/continuous.py) with p = the fitted send probability
  (geometric runs, the chain's assumption);
- the simulator (tokenrouter/planner/sim.py) with the measured run-length distribution (Kaplan-Meier)
  and the runtime's costs charged per request: the model that takes the measured pattern.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/send_patterns.py --profile profiles/paper_qwen3_0.6b_32b_a100.json \\
        --runtime cal.json --plot docs/bench/send_patterns.png

Routers: `bernoulli` (the built-in synthetic router, p per position) and `renewal`
(benchmarks/renewal_router.py: a chosen run-length histogram, bursty by default). The router heads
(CITER, R2R, Co-LLM) need hidden states, which the latency-model executor does not compute.
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
from tokenrouter.bench.trace_reader import latency_ratio, read_trace, runtime_costs, send_runs
from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.engine.step_trace import ENV as TRACE_ENV
from tokenrouter.models.random_model import build_random_model
from tokenrouter.planner import Overheads, throughput_curve
from tokenrouter.planner.gaps import fit_runs
from tokenrouter.planner.sim import simulate
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig

sys.path.insert(0, os.path.dirname(__file__))
from ablation import closed_loop, latencies, load_overheads, prompts_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def router_spec(spec: str) -> tuple[str, dict]:
    """'bernoulli:p=0.1' or 'renewal:runs=1:1,19:1' -> (algorithm name or file spec, parameters)."""
    name, _, rest = spec.partition(":")
    params = {}
    if rest:
        key, _, value = rest.partition("=")
        params[key] = float(value) if key == "p" else value
    if name == "renewal":
        return f"{HERE}/renewal_router.py:Renewal", params
    return name, params


def group(path: str, profile: dict, algorithm: str, params: dict, alpha: float) -> GroupConfig:
    prof = {**profile, "interference": {"small": {"large": alpha}}}
    return GroupConfig.from_dict({
        "models": [{"name": "small", "path": path, "kv_cache_tokens": 1 << 16, "max_running_requests": 64},
                   {"name": "large", "path": path, "kv_cache_tokens": 1 << 16, "max_running_requests": 64}],
        # look-ahead off, as these figures were measured: the gaps alone against the chains (docs/DESIGN.md 5.12)
        "algorithm": {"name": algorithm, **params}, "launch": {"policy": "eager", "look_ahead": False},
        "executor": {"mode": "latency", "profile": prof}})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--routers", nargs="+", default=["bernoulli:p=0.1", "renewal:runs=1:1,19:1"])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--b", default="1,3,5", help="thresholds B to measure")
    ap.add_argument("--interference", default="0,1")
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--runtime", default=None, help="calibration JSON (benchmarks/ablation.py --calibrate)")
    ap.add_argument("--sim-steps", type=int, default=60_000)
    ap.add_argument("--plot", default=None, help="PNG: measured run lengths against the geometric fit")
    ap.add_argument("--out", default=None, help="JSON with every figure")
    args = ap.parse_args()
    torch.set_num_threads(1)
    profile = LatencyProfile.load(args.profile)
    lat_s, lat_l = latencies(profile)
    overheads = load_overheads(profile, args.runtime)
    path = str(build_random_model(os.path.join(tempfile.mkdtemp(), "m"), "llama", "tiny", seed=0))
    trace_dir = tempfile.mkdtemp(prefix="steptrace-")
    os.environ[TRACE_ENV] = trace_dir
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    bs = [int(b) for b in args.b.split(",")]
    report = {"n": args.n, "overheads": overheads.__dict__, "routers": {}}
    for spec in args.routers:
        algorithm, aparams = router_spec(spec)
        sent: list[int] = []
        cut: list[int] = []
        l_sent: list[int] = []
        runs = []
        for alpha in [float(a) for a in args.interference.split(",")]:
            entry = Entry(group(path, profile.to_dict(), algorithm, aparams, alpha))
            try:
                for b in bs:
                    t0 = time.perf_counter()
                    res = closed_loop(entry, args.n, b, prompts_for(args.waves * args.n), params)
                    t1 = time.perf_counter()
                    steps = read_trace(trace_dir, t0, t1)
                    r = send_runs(steps, 0)
                    if not runs:  # the routers draw per (request seed, position): every run sends alike
                        sent, cut, l_sent = r.sent, r.cut, send_runs(steps, 1).sent
                    costs = runtime_costs(steps)
                    runs.append({"alpha": alpha, "b": b, "steady": res.steady_throughput, "whole": res.throughput,
                                 "s_step_gap": costs.s_step_gap or overheads.s_overhead,
                                 "l_step_gap": costs.l_step_gap or overheads.l_overhead, "window": [t0, t1],
                                 "s_ratio": latency_ratio(steps, 0, profile.models["small"], apart_from=1),
                                 "l_ratio": latency_ratio(steps, 1, profile.models["large"])})
                    print(f"{spec} alpha={alpha:g} B={b}: {res.steady_throughput:.1f} tok/s steady, "
                          f"{len(r.sent)} runs sent, {len(r.cut)} cut", flush=True)
            finally:
                entry.close()
        fit = fit_runs(sent, cut)
        gaps = fit.gap_histogram()
        print(f"{spec}: {json.dumps(fit.to_json())}; large-model spans: {sorted(set(l_sent))}", flush=True)
        for run in runs:
            alpha, b = run["alpha"], run["b"]
            # the run's own per-step gaps (the machine is shared: the runtime's overhead drifts between
            # runs), the hand-off latency from the calibration, as benchmarks/ablation.py --report does
            own = Overheads(s_token=overheads.s_token, l_token=overheads.l_token, s_overhead=run["s_step_gap"],
                            l_overhead=run["l_step_gap"], handoff=overheads.handoff)
            geo = float(throughput_curve(args.n, fit.p, lat_s, lat_l, alpha, overheads=own)[b - 1])
            sim = simulate(args.n, b, lat_s, lat_l, alpha, gaps=gaps, overheads=own, s_steps=args.sim_steps)
            # and with the run's own step latencies: its steps against the profile's (a loaded host
            # stretches the executor's sleeps)
            rs, rl = run["s_ratio"], run["l_ratio"]
            rs = rs if rs == rs else 1.0
            own_s, own_l = (lambda b_, rs=rs: rs * lat_s(b_)), (lambda b_, rl=rl: rl * lat_l(b_))
            geo_own = float(throughput_curve(args.n, fit.p, own_s, own_l, alpha, overheads=own)[b - 1])
            sim_own = simulate(args.n, b, own_s, own_l, alpha, gaps=gaps, overheads=own, s_steps=args.sim_steps)
            run.update(geometric_own=geo_own, measured_runs_own=sim_own.throughput,
                       geometric_own_error=geo_own / run["steady"] - 1,
                       measured_runs_own_error=sim_own.throughput / run["steady"] - 1)
            run.update(geometric_chain=geo, measured_runs_model=sim.throughput, measured_runs_stderr=sim.stderr,
                       geometric_error=geo / run["steady"] - 1, measured_runs_error=sim.throughput / run["steady"] - 1)
        report["routers"][spec] = {"fit": fit.to_json(), "runs": runs, "steps": fit.steps.tolist(),
                                   "pmf": fit.pmf.tolist(), "survival": fit.survival.tolist(),
                                   "large_spans": sorted(set(l_sent))}
    print("\n| router | runs (cut) | fitted p | mean run | CV (geometric) | chi-square (dof), p-value | KS distance |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for spec, r in report["routers"].items():
        print(f"| {spec} | {fit_cells(r['fit'], p_digits=4)} |")
    print("\n| router | placement | B | measured tok/s | geometric chain (error) | measured-runs model (error) | "
          "step-latency ratio S / L | geometric, own latencies | measured-runs, own latencies |")
    print("|---|---|---:|---:|---|---|---|---|---|")
    for spec, r in report["routers"].items():
        for run in r["runs"]:
            a = run["alpha"]
            place = "separate" if a == 0 else "co-located" if a == 1 else f"alpha {a:g}"
            print(f"| {spec} | {place} | {run['b']} | {run['steady']:.1f} | {run['geometric_chain']:.1f} "
                  f"({100 * run['geometric_error']:+.1f}%) | {run['measured_runs_model']:.1f} +- "
                  f"{run['measured_runs_stderr']:.1f} ({100 * run['measured_runs_error']:+.1f}%) | "
                  f"{run['s_ratio']:.3f} / {run['l_ratio']:.3f} | {100 * run['geometric_own_error']:+.1f}% | "
                  f"{100 * run['measured_runs_own_error']:+.1f}% |")
    for spec, r in report["routers"].items():
        ge = [abs(x["geometric_error"]) for x in r["runs"]]
        me = [abs(x["measured_runs_error"]) for x in r["runs"]]
        go = [abs(x["geometric_own_error"]) for x in r["runs"]]
        mo = [abs(x["measured_runs_own_error"]) for x in r["runs"]]
        print(f"{spec}: mean |error| geometric chain {100 * np.mean(ge):.1f}% (max {100 * max(ge):.1f}%), "
              f"measured-runs model {100 * np.mean(me):.1f}% (max {100 * max(me):.1f}%); with each run's own "
              f"step latencies: {100 * np.mean(go):.1f}% (max {100 * max(go):.1f}%) and {100 * np.mean(mo):.1f}% "
              f"(max {100 * max(mo):.1f}%)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return 0


def fit_cells(f: dict, p_digits: int = 3) -> str:
    """A run-length fit (GapFit.to_json) as table cells: runs (cut), p, mean run, CV (geometric's),
    hazard chi-square (dof) with its p-value, Kaplan-Meier distance."""
    return (f"{f['runs']} ({f['censored']}) | {f['p']:.{p_digits}f} | {f['mean_steps']:.2f} | "
            f"{f['cv']:.3f} ({f['geometric_cv']:.3f}) | {f['chi2']:.1f} ({f['dof']}), {f['p_value']:.3g} | "
            f"{f['ks']:.3f}")


def plot(report: dict, out: str, title: str | None = None, xlim: tuple[int, int] = (60, 80)) -> None:
    """Each router's run-length pmf and survival against the geometric fit (send_patterns_pair.py
    draws its routers with this too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(report["routers"])
    fig, axes = plt.subplots(2, len(specs), figsize=(5.5 * len(specs), 7), squeeze=False)
    for i, spec in enumerate(specs):
        r = report["routers"][spec]
        k = np.array(r["steps"])
        p = r["fit"]["p"]
        ax = axes[0][i]
        ax.bar(k, r["pmf"], width=0.8, alpha=0.6, label="measured (Kaplan-Meier)")
        ax.plot(k, p * (1 - p) ** (k - 1), "r.-", label=f"geometric, p = {p:.3f}")
        ax.set_xlim(0, min(len(k), xlim[0]) + 1)
        ax.set_title(f"{spec}: chi-square p = {r['fit']['p_value']:.2g}, mean {r['fit']['mean_steps']:.2f}")
        ax.set_xlabel("run length (small-model steps between sends)")
        ax.set_ylabel("probability")
        ax.legend()
        ax = axes[1][i]
        ax.semilogy(k, r["survival"], "b-", label="measured P(run > k)")
        ax.semilogy(k, (1 - p) ** k, "r--", label="geometric")
        ax.set_xlim(0, min(len(k), xlim[1]) + 1)
        ax.set_ylim(1e-3, 1.1)
        ax.set_xlabel("k")
        ax.set_title(f"KS distance {r['fit']['ks']:.3f}")
        ax.legend()
    fig.suptitle(title or f"Run lengths between sends, from the step trace (N = {report['n']}, paper profile)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
