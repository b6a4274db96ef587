"""A routed group's throughput without HTTP: the entry driven in a closed loop on CHAMP prompts
(`tokenrouter.bench.offline`), optionally with the large model's launch threshold fixed at B.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/offline_closed_loop.py --config PAIR.yaml --large-threshold 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tokenrouter.bench.offline import run_closed_loop
from tokenrouter.bench.workloads import build_prompts
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a routed group of two models (small first)")
    ap.add_argument("--large-threshold", type=int, nargs="*", default=[],
                    help="run once per B with `launch: threshold` B at the large model (none: the config's launch)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = GroupConfig.from_yaml(args.config)
    prompts, _ = build_prompts("reasoning-low", "cpu", args.num_requests, 0)
    ids = [load_tokenizer(base.models[0].engine.model_path).encode(p) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for b in args.large_threshold or [None]:
        d = base.to_dict()
        if b is not None:
            d["launch"] = {"policy": "threshold", "thresholds": {base.names[1]: b}}
        entry = Entry(GroupConfig.from_dict(d))
        try:
            run_closed_loop(entry, ids[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), 2)
            r = run_closed_loop(entry, ids, params, args.concurrency)
        finally:
            entry.close()
        print(json.dumps({"large_threshold": b, "throughput": round(r.throughput, 1),
                          "steady_throughput": round(r.steady_throughput, 1),
                          "per_user": round(r.mean_per_user, 1), "tokens_per_model": r.tokens_per_model}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
