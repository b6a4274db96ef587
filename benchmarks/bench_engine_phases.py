"""The engine's phases one at a time, profiled per op or paired between two source trees.

Phases (greedy, EOS ignored, float32 on CPU, eager steps, one torch thread):
  e2e          32 requests x (128 prompt ids + 128 output tokens), prefill included: 32 * 128 / wall.
               The same workload as `bench_vllm.py`'s "prefill" run (its `ours` system).
  prefill      32 x 128 prompt ids, one output token each (two 2048-token chunks): ms for all of it.
  decode-bsB   B requests of 128 prompt ids (prefill untimed), then decode steps: median ms/step.
  extend-E     8 requests of 128 prompt ids decoding; each round every request receives E new
               tokens written elsewhere (`Engine.receive`, as a routed pair's catch-up does) and one
               step extends all 8 (8 x E rows) and samples: median ms/step.

    # per-op profile (torch.profiler) of every phase, on SmolLM2-135M-Instruct:
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engine_phases.py --profile
    # A against B: alternating runs of two checkouts (A first), paired ratios A/B of each phase's time:
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engine_phases.py --trees /path/A,/path/B --rounds 3

Each run is its own process (`--worker`); with --trees, tree T's `tokenrouter` is imported
(PYTHONPATH=T). Only the engine's public API is used, so older checkouts run unchanged. The e2e
phase's greedy tokens are compared between the trees.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("e2e", "prefill", "decode-bs1", "decode-bs8", "extend-2", "extend-8", "extend-32", "extend-64")
QUICK = dict(e2e=(4, 16, 8), prefill=(4, 16), decode_steps=3, extend_rounds=2, extend_reqs=2, prompt=16)
FULL = dict(e2e=(32, 128, 128), prefill=(32, 128), decode_steps=20, extend_rounds=4, extend_reqs=8, prompt=128)


def _prompts(rng: random.Random, vocab: int, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def worker(args: argparse.Namespace) -> dict:
    import torch

    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.engine.engine import Engine
    from tokenrouter.sampling_params import SamplingParams

    torch.set_num_threads(1)
    sizes = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model_path=args.model_path, device="cpu", dtype="float32", num_threads=1,
                              max_running_requests=32, kv_cache_tokens=32 * 512, disable_cuda_graph=True,
                              load_tokenizer=False))
    startup = time.perf_counter() - t0
    vocab = eng.model_config.vocab_size
    rng = random.Random(args.seed)
    phases = [p for p in args.phases.split(",") if p]
    out: dict = dict(startup_s=startup, phases={})
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
    prof = None

    @contextlib.contextmanager
    def timed():
        """The timed part of a phase (profiled with --profile)."""
        nonlocal prof
        if not args.profile:
            yield
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def timed_steps(n: int, before=None) -> list[float]:
        times = []
        for _ in range(n):
            if before is not None:
                before()
            t = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t) * 1e3)
        return times

    def finish() -> None:
        for rid in list(eng.reqs):
            eng.abort(rid)
        eng.cache.reset()

    # a short warm-up: prefill, decode and extend shapes once
    warm = [eng.add_request(p, params(3)) for p in _prompts(rng, vocab, 2, 24)]
    while eng.has_unfinished():
        eng.step()
    del warm
    for phase in phases:
        rec: dict = {}
        if phase == "e2e":
            n, p, o = sizes["e2e"]
            reqs = [eng.add_request(x, params(o)) for x in _prompts(rng, vocab, n, p)]
            with timed():
                t = time.perf_counter()
                while eng.has_unfinished():
                    eng.step()
                wall = time.perf_counter() - t
            rec = dict(ms=wall * 1e3, tok_per_s=n * o / wall, tokens=[r.output_ids for r in reqs])
        elif phase == "prefill":
            n, p = sizes["prefill"]
            for x in _prompts(rng, vocab, n, p):
                eng.add_request(x, params(1))
            with timed():
                t = time.perf_counter()
                while eng.has_unfinished():
                    eng.step()
                rec = dict(ms=(time.perf_counter() - t) * 1e3)
        elif phase.startswith("decode-bs"):
            b = int(phase.removeprefix("decode-bs"))
            steps = sizes["decode_steps"]
            for x in _prompts(rng, vocab, b, sizes["prompt"]):
                eng.add_request(x, params(steps + 4))
            while any(r.kv_len < r.prompt_len for r in eng.reqs.values()):
                eng.step()
            with timed():
                times = timed_steps(steps)
            rec = dict(ms=statistics.median(times), tok_per_s=b * 1e3 / statistics.median(times))
        elif phase.startswith("extend-"):
            e = int(phase.removeprefix("extend-"))
            rounds = sizes["extend_rounds"]
            prompts = _prompts(rng, vocab, sizes["extend_reqs"], sizes["prompt"])
            reqs = [eng.add_request(x, params(10_000)) for x in prompts]
            while any(r.num_output == 0 for r in reqs):
                eng.step()

            def hand_back() -> None:
                for r in reqs:
                    eng.receive(r.rid, len(r.tokens), [rng.randrange(3, vocab) for _ in range(e)])

            with timed():
                times = timed_steps(rounds, hand_back)
            rec = dict(ms=statistics.median(times), rows=e * len(reqs))
        else:
            raise SystemExit(f"unknown phase {phase!r}; choose from {', '.join(PHASES)}")
        finish()
        if prof is not None:
            rec["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows,
                                                     max_name_column_width=40)
        out["phases"][phase] = rec
    return out


def run_worker(tree: str | None, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    cmd = [sys.executable, __file__, "--worker", "--result", result, "--model-path", args.model_path,
           "--phases", args.phases, "--seed", str(args.seed), "--profile-rows", str(args.profile_rows)]
    cmd += (["--quick"] if args.quick else []) + (["--profile"] if args.profile else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("TOKENROUTER_DISABLE_CUDA_GRAPH", None)
    if tree is not None:
        env["PYTHONPATH"] = tree
    try:
        subprocess.run(cmd, env=env, check=True, timeout=args.timeout)
        return json.loads(Path(result).read_text())
    finally:
        os.unlink(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="Hugging Face folder (default: SmolLM2-135M-Instruct, prepared once)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--trees", help="A,B: two checkouts to pair (alternating runs, A first)")
    ap.add_argument("--rounds", type=int, default=3, help="--trees: A/B pairs")
    ap.add_argument("--profile", action="store_true", help="print a per-op profile of each phase")
    ap.add_argument("--profile-rows", type=int, default=18)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: proves the script end to end")
    ap.add_argument("--seed", type=int, default=0, help="prompt ids")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    ap.add_argument("--out", help="append the figures (no tokens) here as JSON lines")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args)))
        return
    if args.model_path is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tokenrouter.training.default_model import ensure_smollm2

        args.model_path = str(ensure_smollm2())
    phases = [p for p in args.phases.split(",") if p]
    if not args.trees:
        res = run_worker(None, args)
        print(f"model {args.model_path} | start-up {res['startup_s']:.1f} s")
        for name in phases:
            rec = res["phases"][name]
            extra = f", {rec['tok_per_s']:.1f} tok/s" if "tok_per_s" in rec else ""
            print(f"\n== {name}: {rec['ms']:.1f} ms{extra}")
            if "profile" in rec:
                print(rec["profile"])
        return
    trees = args.trees.split(",")
    if len(trees) != 2:
        ap.error("--trees takes two paths, A,B")
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for i in range(args.rounds):
        for t in trees:
            print(f"round {i + 1}/{args.rounds}: {t} ...", flush=True)
            runs[t].append(run_worker(t, args))
    a, b = trees
    print(f"\nmodel {args.model_path} | {args.rounds} alternating pairs, A={a}, B={b}")
    print(f"{'phase':<12}{'A ms (median)':>15}{'B ms (median)':>15}{'A/B per pair':>28}{'A/B median':>12}")
    figures = {}
    for name in phases:
        ta = [r["phases"][name]["ms"] for r in runs[a]]
        tb = [r["phases"][name]["ms"] for r in runs[b]]
        ratios = [x / y for x, y in zip(ta, tb)]
        figures[name] = dict(a_ms=ta, b_ms=tb, ratio=ratios, ratio_median=statistics.median(ratios))
        print(f"{name:<12}{statistics.median(ta):>15.1f}{statistics.median(tb):>15.1f}"
              f"{' '.join(f'{x:.2f}' for x in ratios):>28}{statistics.median(ratios):>12.2f}")
    if "e2e" in phases:
        same = [sum(x == y for x, y in zip(ra["phases"]["e2e"]["tokens"], rb["phases"]["e2e"]["tokens"]))
                for ra, rb in zip(runs[a], runs[b])]
        n = len(runs[a][0]["phases"]["e2e"]["tokens"])
        print(f"e2e greedy tokens, B same as A: {same} of {n} requests per pair")
        figures["e2e_same_tokens"] = same
    print("start-up s: A " + " ".join(f"{r['startup_s']:.1f}" for r in runs[a])
          + " | B " + " ".join(f"{r['startup_s']:.1f}" for r in runs[b]))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), trees=trees, rounds=args.rounds,
                                    model=args.model_path, figures=figures)) + "\n")


if __name__ == "__main__":
    main()
