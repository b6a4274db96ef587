"""The default pair's shapes on one device: the routed pair against its large model alone, in a
closed loop through the entry (no HTTP), at several concurrencies.

The real weights (538 + 156 MB) do not travel to a lent GPU machine, so both models are random-weight
models of the prepared pair's shapes (SmolLM2-135M: 30 layers; the student: the same widths, 3
layers; vocabulary 49,152, tied heads) and the router is a Bernoulli draw at `--share` (the served
R2R router of the earlier float32 default pair sent 26 % of the tokens to SmolLM2 at concurrency 8;
today's pair 25 %, docs/BENCHMARKS.md "Against llama.cpp on the same GGUF file"). Throughput
depends on the shapes, the share and the send pattern, not on the weights: every request writes
`--max-tokens` tokens (EOS ignored). Both models sit on the same device (`--device`, e.g. cuda:0 or
cpu), each with its own subserver process; the engines keep their defaults for that device (CUDA
graphs on CUDA for steps of up to `--graph-bs` new tokens, decodes and catch-ups; eager on CPU).

    python benchmarks/gpu_pair.py --device cuda:0 --concurrency 1 8 32

Prints, per concurrency, the steady-state output tok/s of SmolLM2's shape alone and of the pair,
their ratio, and the share of tokens the large model wrote.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from tokenrouter.bench.offline import run_closed_loop
from tokenrouter.models.random_model import build_random_model
from tokenrouter.runtime.entry.entry import Entry
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams

# SmolLM2-135M-Instruct's shape (its config.json); the prepared student keeps it with 3 layers.
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
               rope_theta=100000.0, tie_word_embeddings=True)
STUDENT_LAYERS = 3


def group(small: str, large: str, device: str, share: float | None, graph_bs: int) -> GroupConfig:
    engine = {"device": device, "kv_cache_tokens": 1 << 16, "max_running_requests": 64,
              "cuda_graph_max_bs": graph_bs}
    models = [{"name": "large", "path": large, **engine}]
    if share is None:
        return GroupConfig.from_dict({"name": "large-alone", "models": models, "algorithm": {"name": "single"}})
    return GroupConfig.from_dict({"name": "pair", "models": [{"name": "small", "path": small, **engine}, *models],
                                  "algorithm": {"name": "bernoulli", "p": share},
                                  "launch": {"policy": "eager"}})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--share", type=float, default=0.26, help="tokens sent to the large model")
    ap.add_argument("--requests-per-slot", type=int, default=4, help="requests per concurrency slot")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=51, help="the arith prompts' mean length")
    ap.add_argument("--graph-bs", type=int, default=32, help="most new tokens a step run as a CUDA graph takes")
    args = ap.parse_args()
    if not 0 < args.share < 1:
        raise SystemExit(f"--share must be in (0, 1), got {args.share}")
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the subservers inherit it
    root = tempfile.mkdtemp(prefix="gpu-pair-")
    large = str(build_random_model(os.path.join(root, "large"), "llama", "tiny", seed=0, **SMOLLM2))
    small = str(build_random_model(os.path.join(root, "small"), "llama", "tiny", seed=1,
                                   **{**SMOLLM2, "num_hidden_layers": STUDENT_LAYERS}))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    print(f"device {args.device}, share {args.share}, {args.max_tokens} tokens a request, prompts of "
          f"{args.prompt_len} ids, {args.requests_per_slot} requests per slot", flush=True)
    results: dict[tuple[str, int], tuple[float, float]] = {}
    for label, share in (("large alone", None), ("pair", args.share)):
        t0 = time.perf_counter()
        entry = Entry(group(small, large, args.device, share, args.graph_bs))
        print(f"{label}: started in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            for n in args.concurrency:
                prompts = [[100 + (977 * i + 31 * j) % 40000 for j in range(args.prompt_len)]
                           for i in range(n * args.requests_per_slot)]
                run_closed_loop(entry, prompts[:n], params, n)  # warm-up: first steps, graphs at this batch
                res = run_closed_loop(entry, prompts, params, n)
                large_share = res.tokens_per_model.get("large", 0) / max(1, res.output_tokens)
                results[(label, n)] = (res.steady_throughput, large_share)
                print(f"{label:12s} N = {n:3d}: {res.steady_throughput:8.1f} tok/s steady "
                      f"({res.throughput:.1f} whole run), large wrote {100 * large_share:.0f} %", flush=True)
        finally:
            entry.close()
    print("\n| concurrency | large alone tok/s | pair tok/s | pair / large | large's share |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.concurrency:
        (alone, _), (pair, share) = results[("large alone", n)], results[("pair", n)]
        print(f"| {n} | {alone:.1f} | {pair:.1f} | {pair / alone:.2f}x | {100 * share:.0f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
