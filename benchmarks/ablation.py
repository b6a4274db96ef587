"""The paper's ablation on the latency-model executor: step-synchronous -> asynchronous (B = 1) ->
asynchronous + delayed batching (the planner's B), with throughput, per-user speed and the share of
the zero-wait bound N / (t_S + p t_L) reached. Also checks the planner's predictions against the
executor for every B (issue 7, item 4) when --check-planner is given.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ablation.py --profile profiles/paper_qwen3_0.6b_32b_a100.json
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
from tokenrouter.baselines.step_sync import run_step_sync
from tokenrouter.bench.offline import run_closed_loop
from tokenrouter.config import EngineConfig
from tokenrouter.engine import Engine
from tokenrouter.entry import Entry
from tokenrouter.group_config import GroupConfig
from tokenrouter.latency_model import InterferenceClock, LatencyModelRunner, LatencyProfile
from tokenrouter.models.config import ModelConfig
from tokenrouter.planner import best_thresholds, throughput_curve, zero_wait_bound
from tokenrouter.random_model import build_random_model
from tokenrouter.routing import make_algorithm


def group(path: str, profile: dict, p: float, launch: dict, interference: float) -> GroupConfig:
    prof = {**profile, "interference": {"small": {"large": interference}}}
    return GroupConfig.from_dict({
        "models": [{"name": "small", "path": path, "kv_cache_tokens": 1 << 16, "max_running_requests": 64},
                   {"name": "large", "path": path, "kv_cache_tokens": 1 << 16, "max_running_requests": 64}],
        "algorithm": {"name": "bernoulli", "p": p}, "launch": launch,
        "executor": {"mode": "latency", "profile": prof}})


def run_async(path: str, profile: dict, p: float, n: int, launch: dict, interference: float, prompts, params):
    entry = Entry(group(path, profile, p, launch, interference))
    try:
        return run_closed_loop(entry, prompts, params, concurrency=n, seed=1)
    finally:
        entry.close()


def run_sync(path: str, profile: LatencyProfile, p: float, n: int, prompts, params):
    cfg = ModelConfig.from_folder(path)
    engines = {}
    for name in ("small", "large"):
        runner = LatencyModelRunner(profile.models[name], cfg.vocab_size, set(cfg.eos_token_ids),
                                    InterferenceClock(0, {}, None))
        engines[name] = Engine(EngineConfig(model_path=path, kv_cache_tokens=1 << 16, max_running_requests=64),
                               latency_runner=runner)
    router = make_algorithm("bernoulli", ["small", "large"], {"p": p})
    return run_step_sync(engines["small"], engines["large"], router, prompts, params, concurrency=n, seed=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--n", type=int, default=8, help="concurrency")
    ap.add_argument("--p", type=float, default=0.1, help="routing probability (bernoulli)")
    ap.add_argument("--interference", type=float, default=None, help="override the profile's alpha of L on S")
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default 2 N)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--check-planner", action="store_true", help="measure every B and compare with the planner")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    profile = LatencyProfile.load(args.profile)
    alpha = args.interference
    if alpha is None:
        alpha = profile.interference.get("small", {}).get("large", 0.0)
    prof_dict = profile.to_dict()
    lat_s = lambda b: profile.models["small"](b, b)  # noqa: E731
    lat_l = lambda b: profile.models["large"](b, b)  # noqa: E731
    n, p = args.n, args.p
    path = str(build_random_model(os.path.join(tempfile.mkdtemp(), "m"), "llama", "tiny", seed=0))
    prompts = [[1 + (i % 200), 2, 3, 4] for i in range(args.requests or 2 * n)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    bound = zero_wait_bound(n, p, lat_s, lat_l)
    table = best_thresholds(n, p, lat_s, lat_l, alpha, min_gain=0.01)
    rows = []

    def report(name: str, thr: float, per_user: float, extra: dict | None = None) -> None:
        row = {"system": name, "n": n, "p": p, "alpha": alpha, "throughput": thr, "per_user": per_user,
               "share_of_bound": thr / bound, **(extra or {})}
        rows.append(row)
        print(f"{name:32s} {thr:9.1f} tok/s   per-user {per_user:7.1f} tok/s   {100 * thr / bound:5.1f}% of bound",
              flush=True)

    print(f"profile {args.profile}: N={n} p={p} alpha={alpha}; zero-wait bound {bound:.1f} tok/s; "
          f"planner B({n}) = {table[n]}", flush=True)
    t0 = time.time()
    sync = run_sync(path, profile, p, n, prompts, params)
    report("step-synchronous", sync.throughput, sum(sync.per_user) / len(sync.per_user))
    eager = run_async(path, prof_dict, p, n, {"policy": "eager"}, alpha, prompts, params)
    report("asynchronous (B=1)", eager.throughput, eager.mean_per_user)
    delayed = run_async(path, prof_dict, p, n, {"policy": "threshold", "thresholds": {"large": {n: table[n]}}},
                        alpha, prompts, params)
    report(f"asynchronous + delayed (B={table[n]})", delayed.throughput, delayed.mean_per_user)
    if args.check_planner:
        predicted = throughput_curve(n, p, lat_s, lat_l, alpha)
        measured = []
        for b in range(1, n + 1):
            res = run_async(path, prof_dict, p, n, {"policy": "threshold", "thresholds": {"large": {n: b}}},
                            alpha, prompts, params)
            measured.append(res.throughput)
            err = (predicted[b - 1] - res.throughput) / res.throughput
            print(f"  B={b:3d}: predicted {predicted[b - 1]:8.1f}  measured {res.throughput:8.1f}  "
                  f"error {100 * err:+.1f}%", flush=True)
            rows.append({"system": "check", "n": n, "p": p, "alpha": alpha, "B": b,
                         "predicted": float(predicted[b - 1]), "measured": res.throughput})
        best_meas = max(range(n), key=lambda i: measured[i]) + 1
        planner_b = table[n]
        within = measured[planner_b - 1] >= 0.97 * max(measured)
        print(f"  planner's B = {planner_b}, measured best B = {best_meas}; planner's B within 3% of the best: "
              f"{within}", flush=True)
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({"profile": args.profile, **row}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
