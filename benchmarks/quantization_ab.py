"""What serving the file's blocks and both cores gave SmolLM2 alone, on this machine, in our server.

Question: on the same code, how fast does `tokenrouter serve --model-path SMOLLM2` answer with the
weights served as the GGUF file stores them and both cores (the defaults) against the float32 weights
on one thread (`--quantization none --no-share-cores`, what the server did before)?

Workload: as benchmarks/llama_cpp_side_by_side.py (held-out arithmetic chat prompts, greedy, EOS
ignored, --max-tokens each, --num-requests per concurrency), fresh servers, the two settings
alternating over --rounds. Prints tok/s and TPOT per setting and concurrency, and the ratio.

    .venv/bin/python benchmarks/quantization_ab.py --rounds 2 --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

SETTINGS = {"served as stored, both cores": [], "float32, one thread": ["--quantization", "none", "--no-share-cores"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from tokenrouter.bench.loadgen import BenchConfig, run_bench
    from tokenrouter.bench.server_process import ServerProcess
    from tokenrouter.bench.workloads import build_prompts
    from tokenrouter.engine.tokenizer import load_tokenizer
    from tokenrouter.training.default_model import ensure_smollm2

    model = str(ensure_smollm2(progress=False))
    prompts, _ = build_prompts("arith", "cpu", args.num_requests, 0, load_tokenizer(model))
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    names = list(SETTINGS)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            srv = ServerProcess(["--model-path", model, "--served-model-name", "m", "--log-level", "warning",
                                 *SETTINGS[name]], startup_timeout=600)
            try:
                for c in args.concurrency:
                    cfg = BenchConfig(base_url=srv.url, model="m", prompts=prompts, max_tokens=args.max_tokens,
                                      num_requests=args.num_requests, concurrency=c, warmup=2)
                    summary, _ = asyncio.run(run_bench(cfg, progress=False))
                    got.setdefault((name, c), []).append((summary["output_throughput"],
                                                          summary["tpot_s"]["median"] * 1e3))
                    print(f"round {r + 1} {name:30s} concurrency {c:2d}: {summary['output_throughput']:7.1f} tok/s",
                          flush=True)
            finally:
                srv.stop()
    for c in args.concurrency:
        new, old = (statistics.median(t for t, _ in got[(n, c)]) for n in names)
        print(f"concurrency {c:2d}: {names[0]} {new:7.1f} tok/s, {names[1]} {old:7.1f} tok/s: {new / old:.2f}x")


if __name__ == "__main__":
    main()
