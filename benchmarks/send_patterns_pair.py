"""Real send patterns of the trained routers (CITER, R2R, Co-LLM) on the prepared default pair: run
lengths between sends read off the runtime's step trace, against the throughput chain's geometric
assumption; and the planner's throughput prediction with either, against the measured throughput.

The default pair (the student and SmolLM2-135M-Instruct on CPU, one torch thread per model) is served
by the real runtime (tokenrouter.runtime.entry.Entry) once per router, at the router's served
threshold (the pair's prepared.json `thresholds`, as pair.yaml serves it), with the step trace on:
with TOKENROUTER_STEP_TRACE set, each subserver's engine writes one line per step listing its requests
(tokenrouter/engine/step_trace.py), exactly as the latency executor does. Prompts: held-out
arithmetic problems (tokenrouter/training/arith.py) and held-out CHAMP problems, chat-formatted as
the routers were trained (training/champ.chat_prompts), answered greedily up to --max-tokens (EOS
ends a request; its last run is then censored). Closed loops at concurrency N, launch threshold B,
after one unmeasured pass over the same prompts (--warmup: the measured runs then find every prompt
in both models' prefix caches, so no B pays the prompts' prefill alone).

From the trace: the small model's run lengths between sends (`send_runs`), the geometric fit and its
goodness of fit (tokenrouter/planner/gaps.py). Then the planner's prediction of the run's steady-state
throughput (tokens per second while N requests are live), with the step latencies, interference and
runtime costs read off the same trace (real models have no profile of this machine at this moment:
the machine is shared, so a profile measured another time would not describe this run):

- t_S(b), t_L(b): least squares of each model's step seconds on [1, batch, tokens beyond one per
  request] over the run's steps; the S fit uses only S steps that overlap no L step;
- interference alpha: the S steps that overlap an L step, their stretch over the fit divided by the
  overlap (the simulator's alpha: S progresses at 1 - alpha while L runs), clipped to [0, 1];
- per-step gaps and hand-off latency: `runtime_costs`.

Then the continuous-time chain (tokenrouter/planner/continuous.py) with the fitted p (the geometric
assumption), the simulator (tokenrouter/planner/sim.py) with the measured run-length distribution
(Kaplan-Meier), the chain with the catch-up of the runs that sent, and the simulator replaying the
measured requests' lives (each request's visits in order, from its first token to its last, each
visit charged the tokens its first step computed, as measured: after the warm-up pass a first visit
to L finds the prompt and the answer's first tokens in L's prefix cache). The chains and the
histogram simulator have no prompt prefill (a new request's prompt on S, and its first hand-off
bringing the whole prompt to L): the share of step time that first visits took is printed beside.
Then where the requests are, measured and replayed (tokenrouter.bench.trace_reader.request_legs), and
L's step as requests live through it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/send_patterns_pair.py --arith 16 --champ 24 --n 8 \\
        --max-tokens 64 --b 1,2,4 --plot docs/bench/send_patterns_pair.png --out docs/bench/send_patterns_pair.json

--look-ahead serves the pair with the large model's look-ahead on (as the group serves it by default):
the answered returns are read off the trace too, the chains are given the share of L's visits they
took (tokenrouter/planner/chain.py `answered`) and the catch-up of the visits that queued, and the
lives are replayed with the simulator's look-ahead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tokenrouter import SamplingParams
from tokenrouter.bench.offline import run_closed_loop
from tokenrouter.bench.trace_reader import Step, read_trace, request_legs, runtime_costs, send_runs, visit_runs
from tokenrouter.engine.step_trace import ENV as TRACE_ENV
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.planner import Overheads, throughput_curve
from tokenrouter.planner.gaps import fit_runs
from tokenrouter.planner.sim import LEGS, simulate
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import SetThresholds
from tokenrouter.training import arith, champ
from tokenrouter.training.prepare import default_pair_config, served_algorithm

sys.path.insert(0, os.path.dirname(__file__))
from send_patterns import fit_cells, plot  # noqa: E402

ROUTERS = ("citer", "r2r", "co_llm")


def prompts(large: str, n_arith: int, n_champ: int) -> list[list[int]]:
    """Held-out arithmetic and CHAMP problems, interleaved, chat-formatted."""
    tok = load_tokenizer(large)
    a = champ.chat_prompts(tok, arith.split().held_out[:n_arith])
    c = champ.chat_prompts(tok, champ.split().held_out[:n_champ])
    out = []
    for i in range(max(len(a), len(c))):
        out += a[i:i + 1] + c[i:i + 1]
    return out


def step_fit(steps: list[Step], features: Callable[[Step], list[float]] | None = None) -> np.ndarray:
    """Least squares of step seconds on `features` (default: [1, batch, tokens beyond one per request])."""
    features = features or (lambda s: [1.0, len(s.rids) + s.ahead, s.rows - len(s.rids) - s.ahead])
    x = np.array([features(s) for s in steps])
    y = np.array([s.end - s.start for s in steps])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef


def overlaps(s: Step, others: np.ndarray) -> float:
    """Seconds of `s` during which one of `others` ((start, end) rows, disjoint) ran."""
    if not len(others):
        return 0.0
    lo = np.maximum(others[:, 0], s.start)
    hi = np.minimum(others[:, 1], s.end)
    return float(np.clip(hi - lo, 0.0, None).sum())


def latencies_from_trace(steps: list[Step]) -> dict:
    """Step latencies, interference and prompt share of a two-model run, read off its trace."""
    s_steps = [s for s in steps if s.model == 0]
    l_steps = [s for s in steps if s.model == 1]
    l_iv = np.array([(s.start, s.end) for s in l_steps])
    ov = np.array([overlaps(s, l_iv) for s in s_steps])
    alone = [s for s, o in zip(s_steps, ov) if o == 0.0]
    cs = step_fit(alone) if len(alone) >= 10 else None
    top = max(len(s.rids) for s in s_steps)
    if cs is None or min(cs[0] + cs[1], cs[0] + cs[1] * top) <= 0:
        cs = step_fit(s_steps)  # too few S steps without L beside them, or too scattered: every S step
    cl = step_fit(l_steps)
    # L's steps again on [1, rows] alone: its batch and the tokens its requests bring move together
    # (each brings about the mean catch-up), so the three-term fit splits their cost arbitrarily
    cl_rows = step_fit(l_steps, lambda s: [1.0, s.rows])
    stretch = sum((s.end - s.start) - (cs[0] + cs[1] * len(s.rids) + cs[2] * (sum(s.extend_lens) - len(s.rids)))
                  for s, o in zip(s_steps, ov) if o > 0)
    alpha = float(np.clip(stretch / ov.sum(), 0.0, 1.0)) if ov.sum() > 0 else 0.0
    # prompt tokens: a request's first step on each model feeds everything it has not seen yet
    seen: set[tuple[int, str]] = set()
    prompt_secs = total = 0.0
    for s in steps:
        took = s.end - s.start
        total += took
        tokens = sum(s.extend_lens)
        first = sum(n for r, n in zip(s.rids, s.extend_lens) if (s.model, r) not in seen)
        seen.update((s.model, r) for r in s.rids)
        prompt_secs += took * first / tokens if first > len(s.rids) and tokens else 0.0
    return {"s_coef": cs.tolist(), "l_coef": cl.tolist(), "l_rows_coef": cl_rows.tolist(), "alpha": alpha,
            "s_alone_steps": len(alone),
            "s_steps": len(s_steps), "l_steps": len(l_steps), "first_visit_share": prompt_secs / total}


def steady_steps(steps: list[Step], window: tuple[float, float], l_coef: list[float]) -> dict:
    """Each model's mean batch and steps per second over the steps that began inside the run's steady
    window (all N requests live), the quantities the simulator reports for its closed system; and L's
    step there, weighted by its batch (as requests live through it), measured and as the run's
    three-term fit `l_coef` puts it, with the tokens beyond one per request it computed."""
    t0, t1 = window
    inside = [s for s in steps if t0 <= s.start < t1]
    out = {}
    for name, m in (("s", 0), ("l", 1)):
        mine = [len(s.rids) for s in inside if s.model == m]
        out[f"{name}_batch"] = float(np.mean(mine)) if mine else 0.0
        out[f"{name}_rate"] = len(mine) / (t1 - t0) if t1 > t0 else float("nan")
    ls = [s for s in inside if s.model == 1]
    if ls:
        b = np.array([len(s.rids) for s in ls], dtype=float)
        extra = np.array([s.rows for s in ls]) - b
        took = np.array([s.end - s.start for s in ls])
        fitted = l_coef[0] + l_coef[1] * b + l_coef[2] * extra
        out.update(l_step_weighted=float(b @ took / b.sum()), l_fit_weighted=float(b @ fitted / b.sum()),
                   l_extra_per_step=float(extra.mean()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default=None, help="a prepared pair folder (pair.yaml, prepared.json); "
                    "default: the default pair, prepared (cached) on first use")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--arith", type=int, default=16, help="held-out arithmetic prompts")
    ap.add_argument("--champ", type=int, default=8, help="held-out CHAMP prompts")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--b", default="1", help="launch thresholds B of the large model to measure")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=1, choices=(0, 1),
                    help="run the prompts once, unmeasured, before the measured runs (prefix caches warm)")
    ap.add_argument("--sim-steps", type=int, default=40_000)
    ap.add_argument("--look-ahead", action="store_true", help="the large model runs ahead (the served default); "
                    "without it, off (as the measurements of docs/BENCHMARKS.md 'Real send patterns')")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", default=None, help="print the tables (and --plot) of an --out JSON, run nothing; "
                    "several, comma-separated: each one's tables, then the errors of the mean prediction across them")
    args = ap.parse_args()
    if args.report:
        reports = [json.loads(Path(f).read_text()) for f in args.report.split(",")]
        for report in reports:
            predict(report, args.sim_steps)
            table(report)
        if len(reports) > 1:
            across(reports)
        if args.plot:
            draw(reports[-1], args.plot)
        return 0
    torch.set_num_threads(1)
    folder = Path(args.pair) if args.pair else default_pair_config().parent
    meta = json.loads((folder / "prepared.json").read_text())
    trace_dir = tempfile.mkdtemp(prefix="steptrace-")
    os.environ[TRACE_ENV] = trace_dir
    ids = prompts(meta["large"], args.arith, args.champ)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    report = {"pair": str(folder), "n": args.n, "prompts": len(ids), "max_tokens": args.max_tokens,
              "warmup": args.warmup, "look_ahead": args.look_ahead,
              "prompt_tokens_mean": float(np.mean([len(p) for p in ids])), "routers": {}}
    for kind in args.routers.split(","):
        algo = served_algorithm(meta, kind)
        if algo is None:
            raise SystemExit(f"{folder}: no {kind} router prepared")
        entry = Entry(GroupConfig.from_dict({
            "name": f"default-{kind}", "models": [{"name": "small", "path": meta["small"]},
                                                 {"name": "large", "path": meta["large"]}],
            "algorithm": algo, "launch": {"policy": "eager", "look_ahead": args.look_ahead}}))
        runs = []
        sent: list[int] = []
        cut: list[int] = []
        l_spans: list[int] = []
        lives: list[list[tuple[int, int, int]]] = []
        try:
            if args.warmup:  # the same prompts run once, unmeasured: every measured run finds them in both
                # models' prefix caches (the first run would otherwise pay the prompts' prefill alone)
                run_closed_loop(entry, ids, params, concurrency=args.n, seed=1)
            for b in [int(x) for x in args.b.split(",")]:
                entry.pool.send("large", SetThresholds({1: b}))
                t0 = time.perf_counter()
                res = run_closed_loop(entry, ids, params, concurrency=args.n, seed=1)
                t1 = time.perf_counter()
                # the returns answered without a step are visits (runs and lives), never step costs
                visits = read_trace(trace_dir, t0, t1, with_answered=True)
                steps = [s for s in visits if not s.answered]
                r = send_runs(visits, 0)
                if not runs:  # greedy answers to the same prompts: every B's run sends alike
                    sent, cut, l_spans = r.sent, r.cut, send_runs(visits, 1).sent
                    lives = list(visit_runs(visits).values())
                l_visits = sum(m == 1 for v in visit_runs(visits).values() for m, _, _ in v)
                costs = runtime_costs(steps)
                lat = latencies_from_trace(steps)
                lat |= steady_steps(steps, res.steady_window, lat["l_coef"])
                if res.steady_window[1] > res.steady_window[0]:
                    lat["legs"] = request_legs(steps, *res.steady_window)
                runs.append({"b": b, "steady": res.steady_throughput, "whole": res.throughput,
                             "answered_share": (len(visits) - len(steps)) / max(l_visits, 1),
                             "tokens": res.output_tokens, "seconds": t1 - t0, "runs_sent": len(r.sent),
                             "runs_cut": len(r.cut), "costs": costs.to_dict(), **lat})
                print(f"{kind} B={b}: {res.steady_throughput:.1f} tok/s steady ({res.output_tokens} tokens, "
                      f"{t1 - t0:.0f} s), {100 * runs[-1]['answered_share']:.0f}% of L's visits answered, "
                      f"{len(r.sent)} runs sent, {len(r.cut)} cut, alpha {lat['alpha']:.2f}", flush=True)
        finally:
            entry.close()
        fit = fit_runs(sent, cut)
        report["routers"][kind] = {"threshold": algo, "fit": fit.to_json(), "runs": runs,
                                   "steps": fit.steps.tolist(), "pmf": fit.pmf.tolist(),
                                   "survival": fit.survival.tolist(), "sent": sent, "cut": cut,
                                   "large_spans": sorted(set(l_spans)), "lives": lives}
        print(f"{kind}: {json.dumps(fit.to_json())}", flush=True)
        if args.out:  # after each router: a slow run keeps what it measured
            Path(args.out).write_text(json.dumps(report, indent=1))
    predict(report, args.sim_steps)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    table(report)
    if args.plot:
        draw(report, args.plot)
    return 0


def run_model(run: dict, handoff: float, catchup: float | None = None) -> tuple[Callable[[int], float],
                                                                                Callable[[int], float], Overheads]:
    """The planner's inputs read off one run's trace: t_S(b), t_L(b) and the runtime's overheads."""
    cs, cl, c = run["s_coef"], run["l_coef"], run["costs"]
    ov = Overheads(s_token=max(cs[2], 0.0), l_token=max(cl[2], 0.0), s_overhead=c["s_step_gap"],
                   l_overhead=c["l_step_gap"], handoff=handoff, catchup=catchup)
    return (lambda b: cs[0] + cs[1] * b), (lambda b: cl[0] + cl[1] * b), ov


def chain_at(n: int, p: float, b: int, lat_s, lat_l, alpha: float, ov: Overheads, what: str,
             answered: float = 0.0) -> float:
    """The continuous chain's throughput at threshold b (`answered`: the share of L's visits
    look-ahead answered); nan past the chain's own limits (a hand-off slower than an S step)."""
    try:
        return float(throughput_curve(n, p, lat_s, lat_l, alpha, overheads=ov, answered=answered)[b - 1])
    except ValueError as e:
        print(f"{what}, B={b}: {e}")
        return float("nan")


def predict(report: dict, sim_steps: int) -> None:
    """The planner's throughput for each measured run: the continuous chain with the fitted p, the
    simulator with the measured run lengths, the chain with the catch-up of the runs that sent, and the
    simulator replaying the measured requests' lives (with L's three-term fit, and with L fitted per row
    alone), all with the run's latencies read off its trace. The hand-off latency is the B = 1 run's
    when there is one: `runtime_costs` counts a hand-off's wait while L was idle, and with B > 1 an idle L also
    waits for the B-th request on purpose. With look-ahead, each run's answered share goes to the chains, their
    catch-up counts over the visits that queued (an answered one fed nothing), and the simulator runs
    look-ahead itself."""
    n = report["n"]
    la = report.get("look_ahead", False)
    for r in report["routers"].values():
        fit = fit_runs(r["sent"], r["cut"])
        gaps = fit.gap_histogram()
        # Runs cut by a request's end never reach L: L's catch-up is the mean of the runs that sent.
        catchup = max(float(np.mean(r["sent"])) - 1.0, 0.0)
        # what L's visits fed, when the lives record it: the chain takes its mean in place of the runs' catch-up
        fed = (float(np.mean([x[2] for v in r["lives"] for x in v if x[0] == 1]))
               if r.get("lives") and len(r["lives"][0][0]) == 3 else None)
        eager = [run["costs"]["handoff"] for run in r["runs"] if run["b"] == 1]
        for run in r["runs"]:
            b = run["b"]
            a = run.get("answered_share", 0.0) if la else 0.0
            lat_s, lat_l, ov = run_model(run, eager[0] if eager else run["costs"]["handoff"])
            geo = chain_at(n, fit.p, b, lat_s, lat_l, run["alpha"], ov, "geometric chain", a)
            sim = simulate(n, b, lat_s, lat_l, run["alpha"], gaps=gaps, overheads=ov, s_steps=sim_steps, look_ahead=la)
            cut = chain_at(n, fit.p, b, lat_s, lat_l, run["alpha"], dataclasses.replace(ov, catchup=catchup / (1 - a)),
                           "chain with the measured catch-up", a)
            steady = run["steady"] or float("nan")  # 0: the run never reached its steady window
            if r.get("lives"):  # JSON from before lives were recorded has none
                life = simulate(n, b, lat_s, lat_l, run["alpha"], lives=r["lives"], overheads=ov, s_steps=sim_steps,
                                look_ahead=la)
                if "l_rows_coef" in run:  # L's cost per row, the same for a request's first row and its catch-up
                    c0, c1 = run["l_rows_coef"]
                    per_row = simulate(n, b, lat_s, (lambda k, c0=c0, c1=c1: c0 + c1 * k), run["alpha"],
                                       lives=r["lives"], overheads=dataclasses.replace(ov, l_token=max(c1, 0.0)),
                                       s_steps=sim_steps, look_ahead=la)
                    run.update(lives_rows_model=per_row.throughput,
                               lives_rows_error=per_row.throughput / steady - 1)
                if fed is not None:  # replay again without what each visit fed, and the chain given its mean
                    run.update(fed_tokens=fed, fed_chain=chain_at(n, fit.p, b, lat_s, lat_l, run["alpha"],
                                                                  dataclasses.replace(ov, catchup=fed / (1 - a)),
                                                                  "chain with what L's visits fed", a))
                    run["fed_chain_error"] = run["fed_chain"] / steady - 1
                    gaps_only = simulate(n, b, lat_s, lat_l, run["alpha"],
                                         lives=[[x[:2] for x in v] for v in r["lives"]], overheads=ov,
                                         s_steps=sim_steps, look_ahead=la)
                    run.update(lives_gaps_model=gaps_only.throughput,
                               lives_gaps_error=gaps_only.throughput / steady - 1)
                run.update(lives_model=life.throughput, lives_stderr=life.stderr,
                           lives_error=life.throughput / steady - 1,
                           lives_s_batch=life.s_batch, lives_l_batch=life.l_batch, lives_legs=life.legs,
                           lives_l_fed=life.l_fed,
                           lives_s_rate=life.s_steps / life.seconds, lives_l_rate=life.l_steps / life.seconds)
            run.update(handoff_used=ov.handoff, geometric_chain=geo, measured_runs_model=sim.throughput,
                       measured_runs_stderr=sim.stderr, geometric_error=geo / steady - 1,
                       measured_runs_error=sim.throughput / steady - 1, catchup_chain=cut,
                       catchup_chain_error=cut / steady - 1, catchup_tokens=catchup)
        r["launch_rule"] = launch_rule(n, fit.p, r["runs"], eager[0] if eager else None, catchup, la)


def launch_rule(n: int, p: float, runs: list[dict], handoff: float | None, catchup: float,
                look_ahead: bool) -> dict | None:
    """The B the planner would launch at, planned from the eager (B = 1) run alone (what a server
    serving eagerly has measured; the chain with the catch-up of the runs that sent), beside the B
    that measured fastest. None without a B = 1 run."""
    eager = next((run for run in runs if run["b"] == 1), None)
    if eager is None or handoff is None:
        return None
    a = eager.get("answered_share", 0.0) if look_ahead else 0.0
    lat_s, lat_l, ov = run_model(eager, handoff, catchup / (1 - a))
    curve = throughput_curve(n, p, lat_s, lat_l, eager["alpha"], overheads=ov, answered=a)
    fastest = max(runs, key=lambda run: run["steady"] or 0.0)
    return {"planned_b": int(np.argmax(curve)) + 1, "planned_tok_s": float(curve.max()),
            "predicted_by_b": {run["b"]: float(curve[run["b"] - 1]) for run in runs if run["b"] <= n},
            "fastest_measured_b": fastest["b"], "fastest_measured_tok_s": fastest["steady"]}


def table(report: dict) -> None:
    print("\n| router | served threshold | runs (censored) | fitted p | mean run (steps) | CV (geometric's) | "
          "hazard chi-square (dof), p-value | Kaplan-Meier distance |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for kind, r in report["routers"].items():
        knob = [v for k, v in r["threshold"].items() if k not in ("name", "router")][0]
        print(f"| {kind} | {knob:.4g} | {fit_cells(r['fit'])} |")
    print("\n| router | B | measured tok/s | geometric chain (error) | measured-runs simulator (error) | "
          "chain, catch-up of the runs that sent (error) | measured lives replayed (error) | t_S(1), t_L(1) ms | "
          "alpha | first-visit share of step time |")
    print("|---|---:|---:|---|---|---|---|---|---:|---:|")
    for kind, r in report["routers"].items():
        for run in r["runs"]:
            cs, cl = run["s_coef"], run["l_coef"]
            print(f"| {kind} | {run['b']} | {run['steady']:.1f} | {run['geometric_chain']:.1f} "
                  f"({100 * run['geometric_error']:+.1f}%) | {run['measured_runs_model']:.1f} +- "
                  f"{run['measured_runs_stderr']:.1f} ({100 * run['measured_runs_error']:+.1f}%) | "
                  f"{run['catchup_chain']:.1f} ({100 * run['catchup_chain_error']:+.1f}%, {run['catchup_tokens']:.1f} "
                  "tokens) | "
                  + (f"{run['lives_model']:.1f} +- {run['lives_stderr']:.1f} ({100 * run['lives_error']:+.1f}%) | "
                     if "lives_model" in run else "(no lives recorded) | ")
                  + f"{1e3 * (cs[0] + cs[1]):.1f}, {1e3 * (cl[0] + cl[1]):.1f} | {run['alpha']:.2f} | "
                  f"{100 * run['first_visit_share']:.0f}% |")
    variant_errors(report, "The lives replayed charging each visit its gap's or span's catch-up, not what it fed",
                   "lives_gaps")
    variant_errors(report, "The chain given the tokens beyond one that L's visits fed, as measured, for the catch-up",
                   "fed_chain", lambda r: f" ({r['runs'][0]['fed_tokens']:.1f} tokens a visit)")
    variant_errors(report, "The lives replayed with L's step cost fitted per row alone, t_L = c0 + c1 x rows",
                   "lives_rows")
    run_table(report, "Where the lives replay differs from the run (measured in the steady window / replayed): mean "
              "batch and steps per second", ("S batch", "L batch", "S steps/s", "L steps/s"),
              ("lives_s_batch", "s_batch"),
              lambda run: [f"{run['s_batch']:.2f} / {run['lives_s_batch']:.2f}",
                           f"{run['l_batch']:.2f} / {run['lives_l_batch']:.2f}",
                           f"{run['s_rate']:.1f} / {run['lives_s_rate']:.1f}",
                           f"{run['l_rate']:.1f} / {run['lives_l_rate']:.1f}"])
    run_table(report, "Where the requests are: mean requests in each leg (tokenrouter.planner.sim.LEGS), measured in "
              "the steady window / replayed; outside: live but in no leg (admitted, not yet stepped)",
              (*LEGS, "outside"), ("legs", "lives_legs"),
              lambda run: [f"{run['legs'][k]:.2f} / {run['lives_legs'][k]:.2f}" for k in LEGS]
              + [f"{report['n'] - sum(run['legs'].values()):.2f}"])
    run_table(report, "L's step as requests live through it (weighted by its batch), ms: measured in the steady "
              "window / the run's fit on those steps / replayed (at B > 1 also holding requests queued between two "
              "steps of a span); and the tokens an L step computed beyond one per request, measured / replayed",
              ("L step ms", "tokens an L step computed beyond one per request"), ("l_step_weighted", "lives_legs"),
              lambda run: [f"{1e3 * run['l_step_weighted']:.1f} / {1e3 * run['l_fit_weighted']:.1f} / "
                           f"{1e3 * run['lives_legs']['on_l'] / (run['lives_l_batch'] * run['lives_l_rate']):.1f}",
                           f"{run['l_extra_per_step']:.1f} / {run['lives_l_fed']:.1f}"])
    print(f"\nThe launch rule at N = {report['n']} (planned from the B = 1 run's trace alone):")
    for kind, r in report["routers"].items():
        rule = r.get("launch_rule")
        if rule is None:
            print(f"- {kind}: no B = 1 run to plan from")
            continue
        measured = {run["b"]: run["steady"] for run in r["runs"]}
        cells = ", ".join(f"B={b}: {rule['predicted_by_b'][b]:.1f} predicted / {measured[b]:.1f} measured"
                          for b in sorted(rule["predicted_by_b"]))
        print(f"- {kind}: the planner picks B = {rule['planned_b']} ({rule['planned_tok_s']:.1f} tok/s predicted); "
              f"fastest measured B = {rule['fastest_measured_b']} ({rule['fastest_measured_tok_s']:.1f} tok/s); "
              f"{cells}")



def run_table(report: dict, title: str, columns: tuple[str, ...], needs: tuple[str, ...],
              cells: Callable[[dict], list[str]]) -> None:
    """A table with one row per router and B, for the runs that hold every key of `needs`."""
    print(f"\n{title}")
    print("| router | B | " + " | ".join(columns) + " |")
    print("|---|---:|" + "---|" * len(columns))
    for kind, r in report["routers"].items():
        for run in r["runs"]:
            if all(k in run for k in needs):
                print(f"| {kind} | {run['b']} | " + " | ".join(cells(run)) + " |")


def variant_errors(report: dict, title: str, key: str, note: Callable[[dict], str] = lambda r: "") -> None:
    """One line per router: a variant's prediction (`<key>` or `<key>_model`) and its error at each B."""
    print(f"\n{title} (error):")
    for kind, r in report["routers"].items():
        value = key if any(key in run for run in r["runs"]) else f"{key}_model"
        cells = [f"B={run['b']}: {run[value]:.1f} ({100 * run[key + '_error']:+.1f}%)" for run in r["runs"]
                 if value in run]
        if cells:
            print(f"- {kind}{note(r)}: " + ", ".join(cells))


def across(reports: list[dict]) -> None:
    """Runs of the same command: the error of the mean prediction against the mean measured
    throughput, per router and B, and the spread of the measurement itself ((max - min) / mean)."""
    cols = (("geometric_chain", "geometric chain"), ("catchup_chain", "chain, catch-up of the runs that sent"),
            ("fed_chain", "chain, what L's visits fed"), ("lives_gaps_model", "lives replayed, gaps' catch-up"),
            ("lives_model", "lives replayed, what each visit fed"))
    print(f"\nAcross {len(reports)} runs: error of the mean prediction against the mean measured throughput")
    print("| router | B | measured tok/s | " + " | ".join(name for _, name in cols) + " | spread of the measurement |")
    print("|---|---:|---|" + "---:|" * (len(cols) + 1))
    for kind in reports[0]["routers"]:
        for i, run in enumerate(reports[0]["routers"][kind]["runs"]):
            same = [rep["routers"][kind]["runs"][i] for rep in reports]
            steady = np.array([r["steady"] for r in same])
            cells = []
            for key, _ in cols:
                vals = np.array([r.get(key, np.nan) for r in same], dtype=float)
                cells.append(f"{100 * (np.mean(vals) / steady.mean() - 1):+.1f} %" if np.isfinite(vals).all()
                             else "n/a")
            print(f"| {kind} | {run['b']} | " + ", ".join(f"{v:.1f}" for v in steady) + " | " + " | ".join(cells)
                  + f" | {100 * np.ptp(steady) / steady.mean():.0f} % |")


def draw(report: dict, out: str) -> None:
    plot(report, out, xlim=(40, 50),
         title=f"Default pair, trained routers at their served thresholds: run lengths from the step trace "
               f"(N = {report['n']}, {report['prompts']} prompts, <= {report['max_tokens']} tokens)")


if __name__ == "__main__":
    sys.exit(main())
