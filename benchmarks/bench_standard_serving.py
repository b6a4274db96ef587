"""Standard serving vs tokenrouter: the same two models and the same Bernoulli router,
served (a) by our routed runtime and (b) the standard-serving way: each model in its own plain
single-model server and an outside coordinator that asks for one token per request
(`tokenrouter.bench.baselines.standard`).

Models: random-weight Llamas sharing the byte-level tokenizer (vocab 320): small = preset "small"
(about 3M parameters), large = preset "30m" with vocab_size=320 (about 27M parameters). The small
model runs on core 0 and the large one on core 1 in both systems (routed: `cores: [0]` / `[1]` in the
group config; standard: `taskset -c 0` / `-c 1` on the plain servers). The routed entry process and
the coordinator are not pinned, nor is the load generator. Every process has one torch thread.

Each system is loaded with `tokenrouter bench` (closed loop, streaming, EOS ignored, greedy) one
after the other; the script prints output throughput per concurrency and the ratio.

    .venv/bin/python benchmarks/bench_standard_serving.py
    .venv/bin/python benchmarks/bench_standard_serving.py --p 0.3 --concurrency 1 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenrouter.bench.baselines.standard_stack import StandardStack  # noqa: E402
from tokenrouter.bench.server_process import ManagedProcess, free_port  # noqa: E402

KV_TOKENS = 32768


def build_models(cache: Path) -> tuple[Path, Path]:
    from tokenrouter.models.random_model import build_random_model

    small, large = cache / "llama-small-seed1", cache / "llama-30m-v320-seed2"
    if not (small / "model.safetensors").exists():
        build_random_model(small, "llama", "small", seed=1)
    if not (large / "model.safetensors").exists():
        build_random_model(large, "llama", "30m", seed=2, vocab_size=320)
    return small, large


def run_bench(url: str, model: str, label: str, out: Path, args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "tokenrouter.cli", "bench", "--base-url", url, "--model", model,
           "--workload", args.workload, "--scale", "cpu", "--max-tokens", str(args.max_tokens),
           "--num-requests", str(args.num_requests), "--concurrency", *map(str, args.concurrency),
           "--out", str(out), "--label", label]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_routed(small: Path, large: Path, out: Path, work: Path, args: argparse.Namespace) -> None:
    cfg = work / "group.yaml"
    kv = f"kv_cache_tokens: {KV_TOKENS}, page_size: {args.routed_page_size}"
    cfg.write_text(
        "name: routed\n"
        "models:\n"
        f"  - {{name: small, path: {small}, cores: [0], {kv}}}\n"
        f"  - {{name: large, path: {large}, cores: [1], {kv}}}\n"
        f"algorithm: {{name: bernoulli, p: {args.p}}}\n")
    port = free_port()
    cmd = [sys.executable, "-m", "tokenrouter.cli", "serve", "--config", str(cfg), "--port", str(port),
           "--log-level", "warning", "--grace-period", "5"]
    srv = ManagedProcess("routed", cmd, port, work)
    try:
        srv.wait_healthy(300)
        run_bench(srv.url, "routed", "tokenrouter", out, args)
    finally:
        srv.stop()


def run_standard(small: Path, large: Path, out: Path, work: Path, args: argparse.Namespace) -> None:
    server_args = ["--kv-cache-tokens", str(KV_TOKENS), "--page-size", str(args.standard_page_size)]
    stack = StandardStack(small, large, args.p, small_cores=[0], large_cores=[1], log_dir=work,
                          server_args=server_args, model_name="standard")
    with stack:
        run_bench(stack.url, "standard", "standard-serving", out, args)


def report(out: Path) -> None:
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    by = {(r["label"], r["concurrency"]): r for r in rows}
    print("\n| system | concurrency | output tok/s | TTFT median s | per-user tok/s | tokens small/large |"
          " hand-offs |\n|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        tpm = r["tokens_per_model"]
        print(f"| {r['label']} | {r['concurrency']} | {r['output_throughput']:.1f} | {r['ttft_s']['median']:.3f} | "
              f"{r['per_user_tok_s']['mean']:.1f} | {tpm.get('small', 0)}/{tpm.get('large', 0)} | {r['handoffs']} |")
    print()
    for (label, c), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if label != "tokenrouter" or ("standard-serving", c) not in by:
            continue
        s = by[("standard-serving", c)]
        print(f"concurrency {c}: tokenrouter {r['output_throughput']:.1f} tok/s, standard serving "
              f"{s['output_throughput']:.1f} tok/s, ratio {r['output_throughput'] / s['output_throughput']:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=float, default=0.1, help="Bernoulli routing probability (default 0.1)")
    ap.add_argument("--workload", default="reasoning-low")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--systems", default="tokenrouter,standard")
    ap.add_argument("--routed-page-size", type=int, default=16, help="KV page size of the routed subservers")
    ap.add_argument("--standard-page-size", type=int, default=1,
                    help="KV page size of the plain servers (1: every resent token's KV is reused from the prefix "
                         "cache, as SGLang's default; larger pages recompute the last partial page per request)")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "tokenrouter-bench-models"))
    ap.add_argument("--out", default=None, help="JSONL results (default: a new file in the work folder)")
    args = ap.parse_args()

    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    small, large = build_models(cache)
    work = Path(tempfile.mkdtemp(prefix="bench-standard-"))
    out = Path(args.out) if args.out else work / "results.jsonl"
    print(f"models: {small}, {large}; logs and results in {work}", flush=True)
    start = time.monotonic()
    for system in args.systems.split(","):
        t = time.monotonic()
        if system == "tokenrouter":
            run_routed(small, large, out, work, args)
        elif system == "standard":
            run_standard(small, large, out, work, args)
        else:
            raise SystemExit(f"unknown system {system!r}")
        print(f"[{system}] done in {time.monotonic() - t:.0f} s", flush=True)
    report(out)
    print(f"total {time.monotonic() - start:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
