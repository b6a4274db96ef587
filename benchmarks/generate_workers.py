"""The large model's offline answers (prepare's answers and R2R-label stages) on one process against
one worker process per core: seconds, the ratio, and whether every token is the same.

The prompts are prepare's arithmetic training problems (`arith.training_problems`), chat-formatted,
answered greedily with at most 32 tokens (as prepare's answers stage asks them), by the prepared
default pair's large model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/generate_workers.py --prompts 768
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tokenrouter import SamplingParams
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.training import arith, champ
from tokenrouter.training.large_answers import generate
from tokenrouter.training.prepare import default_pair_config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    meta = json.loads((default_pair_config().parent / "prepared.json").read_text())
    ids = champ.chat_prompts(load_tokenizer(meta["large"]), list(arith.training_problems(args.prompts)))
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens)] * len(ids)
    took = {}
    tokens = {}
    for w in (1, args.workers):
        t0 = time.perf_counter()
        outs = generate(meta["large"], ids, params, progress=False, workers=w)
        took[w] = time.perf_counter() - t0
        tokens[w] = [list(o.outputs[0].token_ids) for o in outs]
        print(f"{w} process(es): {took[w]:.1f} s for {len(ids)} prompts "
              f"({sum(map(len, tokens[w])) / took[w]:.1f} tok/s)", flush=True)
    same = sum(a == b for a, b in zip(tokens[1], tokens[args.workers]))
    print(f"{args.workers} workers / 1: {took[1] / took[args.workers]:.2f}x faster; "
          f"{same} of {len(ids)} answers token-identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
