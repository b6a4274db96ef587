"""Decode-step cost of the default pair's small model against its large model, in our engine.

Both engines live in this process on one torch thread; their decode steps are timed in alternating
rounds (small, large, small, ...) so that whatever else runs on the machine weighs on both alike,
and the median over rounds is reported with the ratio (target: small <= 1/4 of large at batch 1 and 8).

    python benchmarks/bench_pair_cost.py [--rounds 5] [--steps 20] [--batch-sizes 1 8]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.profiler import decode_seconds
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
    engines = {name: Engine(EngineConfig(model_path=str(path), max_running_requests=max(args.batch_sizes)))
               for name, path in (("small", pair.small), ("large", pair.large))}
    for e in engines.values():
        decode_seconds(e, 1, args.context, 3)  # warm-up
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for b in args.batch_sizes:
            for name, e in engines.items():
                times.setdefault((name, b), []).append(decode_seconds(e, b, args.context, args.steps))
    print("| batch | small (ms/step) | large (ms/step) | small / large |")
    print("|---|---|---|---|")
    for b in args.batch_sizes:
        s, g = statistics.median(times[("small", b)]), statistics.median(times[("large", b)])
        print(f"| {b} | {s * 1e3:.1f} | {g * 1e3:.1f} | {s / g:.3f} |")


if __name__ == "__main__":
    main()
