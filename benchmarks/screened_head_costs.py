"""The screened head (tokenrouter/models/screened_head.py) against the full float32 head on the skinny
GEMM, on a real model's head and the hidden states it decodes with.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/screened_head_costs.py --model MODEL_DIR

The model (the default pair's student: the first model of its pair.yaml in the cache) decodes the
arith workload's chat prompts greedily through our engine, keeping each step's final hidden states;
then, for each row count, batches of those rows go through both heads in turn, `--rounds` times, each
keeping its best. Printed: ms a call for the full head and the screened one (argmax only, as greedy
decoding asks, and with the top `--top` logits, as R2R's router reads), their ratio, and how many
columns a row needed computed exactly (per row alone, and the union over the batch). Every batch's
argmax and top logits are checked equal to the full head's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from tokenrouter.bench.workloads import build_prompts
from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutputSpec
from tokenrouter.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from skinny_gemm_costs import best  # noqa: E402


def hidden_states(eng: Engine, requests: int, max_tokens: int) -> torch.Tensor:
    prompts, _ = build_prompts("arith", "cpu", requests, tokenizer=eng.tokenizer)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    rows = []
    while eng.has_unfinished():
        out = eng.step().step
        if out is not None and out.hidden is not None:
            rows.append(out.hidden.clone())
    return torch.cat(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (the default pair: its pair.yaml's first)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--top", type=int, default=32, help="top logits asked for (R2R's router reads 32)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = args.model
    eng = Engine(EngineConfig(model_path=path, device="cpu", kv_cache_tokens=8192, linear_backend="skinny"),
                 outputs=StepOutputSpec(hidden=True))
    head, screened = eng.model, eng.model.lm_head_screened
    if screened is None:
        raise SystemExit("no screened head: the skinny GEMM could not be built (see the log)")
    states = hidden_states(eng, args.requests, args.max_tokens)
    vocab = head.config.vocab_size
    print(f"{path}: head {vocab} x {states.shape[1]}, {len(states)} decode rows of the arith prompts")
    alone = []
    for r in range(len(states)):
        cols = screened.columns(states[r:r + 1], args.top)
        assert cols is not None
        alone.append(len(cols))
    q = statistics.quantiles(alone, n=10)
    print(f"columns computed exactly for the top {args.top}, a row alone: median {statistics.median(alone):.0f}, "
          f"p90 {q[-1]:.0f}, max {max(alone)} of {vocab}")
    print(f"{'rows':>4} {'full ms':>8} {'argmax ms':>9} {'x':>6} {'top-k ms':>8} {'x':>6} {'union':>6}")
    gen = torch.Generator().manual_seed(0)
    for n in args.rows:
        x = states[torch.randperm(len(states), generator=gen)[:n]].contiguous()
        full = head.compute_logits(x)
        got = screened.top(x, args.top)
        assert got is not None and torch.equal(got.argmax, full.argmax(dim=1))
        assert got.values is not None and torch.equal(got.values, full.topk(args.top, dim=1).values)
        t_full = 1e3 * best(lambda: head.compute_logits(x), args.rounds)  # noqa: B023 - timed at once
        t_arg = 1e3 * best(lambda: screened.top(x, 0), args.rounds)  # noqa: B023
        t_top = 1e3 * best(lambda: screened.top(x, args.top), args.rounds)  # noqa: B023
        union = screened.columns(x, args.top)
        assert union is not None
        print(f"{n:>4} {t_full:>8.2f} {t_arg:>9.2f} {t_full / t_arg:>5.2f}x {t_top:>8.2f} {t_full / t_top:>5.2f}x "
              f"{len(union):>6}")


if __name__ == "__main__":
    main()
