"""/health latency while maximum-size prompts are tokenised.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_health_latency.py [--model-path DIR]

Starts `tokenrouter serve` (a random-weight Llama with the repository's test tokenizer unless
--model-path names a model folder), sends --concurrent prompts of --max-prompt-chars characters each
(the largest the server accepts), and polls /health every 50 ms while they are tokenised. Prompt
tokenisation runs in the server's tokenizer thread pool, so /health should answer within a second;
before, it ran on the event loop and /health waited for it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tokenrouter.bench.server_process import ServerProcess
from tokenrouter.models.random_model import build_random_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--max-prompt-chars", type=int, default=1 << 20)
    ap.add_argument("--concurrent", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or str(build_random_model(Path(tmp) / "model", "llama", "tiny", seed=1))
        srv = ServerProcess(["--model-path", path, "--served-model-name", "m", "--kv-cache-tokens", "4096",
                             "--max-prompt-chars", str(args.max_prompt_chars)])
        try:
            rng = random.Random(0)
            words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
            prompt = " ".join(rng.choices(words, k=args.max_prompt_chars // 4))[:args.max_prompt_chars]
            done: list[tuple[int, float]] = []

            def big() -> None:
                t0 = time.monotonic()
                r = httpx.post(f"{srv.url}/v1/completions", timeout=600,
                               json={"model": "m", "prompt": prompt, "max_tokens": 1})
                done.append((r.status_code, time.monotonic() - t0))

            threads = [threading.Thread(target=big) for _ in range(args.concurrent)]
            started = time.monotonic()
            for t in threads:
                t.start()
            health: list[float] = []
            while any(t.is_alive() for t in threads) and time.monotonic() - started < 600:
                t0 = time.monotonic()
                httpx.get(f"{srv.url}/health", timeout=60).raise_for_status()
                health.append(time.monotonic() - t0)
                time.sleep(0.05)
            for t in threads:
                t.join()
        finally:
            srv.stop()
    print(f"{args.concurrent} prompts of {len(prompt)} characters: answered {sorted(s for s, _ in done)} "
          f"in {max(d for _, d in done):.1f} s (the prompts exceed the context, so 400 after tokenising)")
    print(f"/health while tokenising: {len(health)} probes, median {statistics.median(health) * 1e3:.1f} ms, "
          f"max {max(health) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
