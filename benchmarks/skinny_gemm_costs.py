"""A decode step's products on the skinny GEMM (tokenrouter/models/skinny_gemm.c) against oneDNN's
packed products (tokenrouter/models/onednn_linear.py), at the row counts decoding runs at.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/skinny_gemm_costs.py

SmolLM2-135M's shapes (30 layers of q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down
576 x 1536, and the 49,152 x 576 head), random weights: a step reads 538 MB, more than any cache,
so each product streams its weight from memory as in serving. Each row count runs both kernels in
turn, `--rounds` times, and keeps each one's best. It also prints one core's read rate (a sum over
as many bytes) as the ceiling, and how far the two kernels' results are apart.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tokenrouter.models import onednn_linear, skinny_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def best(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernel = skinny_gemm.load_kernel()
    if kernel is None:
        raise SystemExit("the skinny GEMM could not be built (see the log)")
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in SHAPES]
    panels = [skinny_gemm.pack(w) for w in weights]
    onednn = [onednn_linear.pack(w) for w in weights]
    total = sum(w.numel() * 4 for w in weights)
    flat = torch.cat([w.reshape(-1) for w in weights])
    read = best(flat.sum, args.rounds)
    del flat
    print(f"{total / 1e6:.0f} MB of weights a step; one core sums them at {total / read / 1e9:.1f} GB/s "
          f"({read * 1e3:.1f} ms)")
    print(f"{'rows':>5} {'skinny ms':>10} {'GB/s':>6} {'oneDNN ms':>10} {'GB/s':>6} {'oneDNN/skinny':>14} "
          f"{'max diff':>9}")
    for rows in args.rows:
        xs = [torch.randn(rows, k, generator=gen) for _, k in SHAPES]
        ours = best(lambda xs=xs: [kernel(x, p, w.shape[0], None) for x, p, w in zip(xs, panels, weights)],
                    args.rounds)
        theirs = best(lambda xs=xs: [onednn_linear.linear(x, p, None) for x, p in zip(xs, onednn)], args.rounds)
        diff = max((kernel(x, p, w.shape[0], None) - onednn_linear.linear(x, o, None)).abs().max().item()
                   for x, p, o, w in zip(xs[:4], panels[:4], onednn[:4], weights[:4]))
        print(f"{rows:>5} {ours * 1e3:>10.1f} {total / ours / 1e9:>6.1f} {theirs * 1e3:>10.1f} "
              f"{total / theirs / 1e9:>6.1f} {theirs / ours:>13.2f}x {diff:>9.1e}")


if __name__ == "__main__":
    main()
