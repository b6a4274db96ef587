"""`tokenrouter bench compare` at paper scale on the latency-model executor.

Every system waits the step latencies of a paper-derived profile (Qwen3-0.6B and Qwen3-32B on A100s),
while HTTP, tokenising, scheduling, KV bookkeeping and transport run for real. The models' folders
give only a config and SmolLM2's tokenizer (real BPE, so CHAMP prompts are about 100 tokens), with a
32k context so that 8192-token answers fit; no weights are read.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper_compare.py --max-tokens 2048 --range-ratio 0.25
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper_compare.py --systems tokenrouter,standard \\
        --num-requests 8 --max-tokens 2048      # then --max-tokens 8192: the 4x output cap

`--predict` adds, per concurrency, what the profile alone allows (the runtime's targets): the small
model's N / t_S, the planner's continuous chain for the eager routed pair (B = 1, the profile's
catch-up tokens, no runtime overhead) and the zero-wait bound N / (t_S + p t_L).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from tokenrouter.bench.compare import SYSTEMS, compare
from tokenrouter.bench.workloads import WORKLOADS
from tokenrouter.engine.latency_model import LatencyProfile
from tokenrouter.planner import Overheads, zero_wait_bound
from tokenrouter.planner.continuous import solve_continuous
from tokenrouter.training.default_model import cache_dir, ensure_smollm2

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 32768


def config_folder() -> Path:
    """SmolLM2's tokenizer and config, with a 32k context and no weights (the executor reads none)."""
    src = ensure_smollm2()
    dst = cache_dir() / "models" / "latency-smollm2-tokenizer-32k"
    if not (dst / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(dir=dst.parent))
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        cfg = json.loads((src / "config.json").read_text())
        cfg["max_position_embeddings"] = CONTEXT
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        try:
            os.rename(tmp, dst)
        except OSError:  # a concurrent run made it first
            shutil.rmtree(tmp)
    return dst


def group_yaml(folder: Path, profile: str, p: float, launch: str, kv_tokens: int, out: Path) -> Path:
    model = {"path": str(folder), "kv_cache_tokens": kv_tokens, "max_running_requests": 128}
    group = {"name": "paper", "models": [{"name": "small", **model}, {"name": "large", **model}],
             "executor": {"mode": "latency", "profile": str(Path(profile).resolve())},
             "launch": {"policy": launch}, "algorithm": {"name": "bernoulli", "p": p}}
    out.write_text(yaml.safe_dump(group, sort_keys=False))
    return out


def predictions(profile: LatencyProfile, p: float, concurrencies: list[int]) -> list[str]:
    small, large = profile.models["small"], profile.models["large"]
    lat_s, lat_l = (lambda b: small(b, b)), (lambda b: large(b, b))
    t_s, t_l = Overheads(s_token=small.per_token, l_token=large.per_token).step_latencies(lat_s, lat_l, p)
    lines = []
    for n in concurrencies:
        chain = solve_continuous(n, 1, p, t_s, t_l).throughput
        lines.append(f"N={n}: small alone N/t_S {n / lat_s(n):.0f} tok/s; routed: continuous chain (B=1) "
                     f"{chain:.0f} tok/s, zero-wait bound {zero_wait_bound(n, p, lat_s, lat_l):.0f} tok/s")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=str(ROOT / "profiles" / "paper_qwen3_0.6b_32b_a100_separate.json"))
    ap.add_argument("--p", type=float, default=0.1, help="bernoulli hand-off probability (the large model's share)")
    ap.add_argument("--launch", default="eager", choices=["eager", "planner"], help="the routed group's launch policy")
    ap.add_argument("--systems", default="tokenrouter,large,standard,step-sync",
                    help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--workload", default="reasoning-low", choices=sorted(WORKLOADS))
    ap.add_argument("--max-tokens", type=int, default=None, help="override the workload's paper-scale cap")
    ap.add_argument("--range-ratio", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--kv-cache-tokens", type=int, default=1 << 20, help="per model (pages are only counted)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="append the rows (JSONL) here")
    ap.add_argument("--predict", action="store_true", help="print the profile's predictions too (see above)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="paper-compare-") as tmp:
        cfg = group_yaml(config_folder(), args.profile, args.p, args.launch, args.kv_cache_tokens,
                         Path(tmp) / "group.yaml")
        compare(str(cfg), [s.strip() for s in args.systems.split(",") if s.strip()], args.workload, "paper",
                args.concurrency, args.num_requests, args.max_tokens, args.seed, args.out, args.range_ratio)
    if args.predict:
        print("\n".join(predictions(LatencyProfile.load(args.profile), args.p, args.concurrency)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
