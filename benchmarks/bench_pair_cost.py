"""Decode-step cost of the default pair's small model against its large model, in our engine.

Both engines live in this process on one torch thread; their decode steps are timed in alternating
rounds (small, large, small, ...) so that whatever else runs on the machine weighs on both alike,
and the median over rounds is reported with the ratio (the target: small <= 0.3 of large).

    python benchmarks/bench_pair_cost.py [--rounds 5] [--steps 20] [--batch-sizes 1 8]
"""

from __future__ import annotations

import argparse

import torch

from tokenrouter.bench.decode_cost import decode_costs
from tokenrouter.training.prepare import prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size and round")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    pair = prepare()
    torch.set_num_threads(1)
    cost = decode_costs({"small": pair.small, "large": pair.large}, args.batch_sizes, args.context, args.steps,
                        args.rounds)
    print("| batch | small (ms/step) | large (ms/step) | small / large |")
    print("|---|---|---|---|")
    for b in args.batch_sizes:
        s, g = cost[("small", b)], cost[("large", b)]
        print(f"| {b} | {s * 1e3:.1f} | {g * 1e3:.1f} | {s / g:.3f} |")


if __name__ == "__main__":
    main()
