"""A load generator for any OpenAI-compatible /v1/completions endpoint, in the style of SGLang's
bench_serving and vLLM's `bench serve`: closed loop at a fixed concurrency, or Poisson arrivals."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

WARMUP_TOKENS = 16  # output cap of each warm-up request


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds to the first token
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    tokens_per_model: dict[str, int] = field(default_factory=dict)
    handoffs: int = 0
    error: str | None = None


@dataclass
class BenchConfig:
    base_url: str
    model: str
    prompts: list[str] | list[list[int]]  # texts, or token ids (sent as they are)
    max_tokens: int
    num_requests: int
    concurrency: int | None = 8  # closed loop; None with request_rate for open loop
    request_rate: float | None = None  # Poisson arrivals per second
    warmup: int = 2
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    seed: int = 0
    timeout: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    output_lens: list[int] | None = None  # per-request caps (request i: output_lens[i]), else max_tokens for all

    def cap(self, i: int) -> int:
        return self.output_lens[i % len(self.output_lens)] if self.output_lens else self.max_tokens


def _pcts(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    s = sorted(xs)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]

    return {"mean": statistics.fmean(s), "median": statistics.median(s), "p90": pct(0.9), "p99": pct(0.99)}


def summarise(cfg: BenchConfig, results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    per_model: dict[str, int] = {}
    for r in done:
        for m, n in r.tokens_per_model.items():
            per_model[m] = per_model.get(m, 0) + n
    speeds = [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in done
              if r.ttft is not None and r.output_tokens > 1 and r.e2e > r.ttft]
    return {
        "model": cfg.model, "concurrency": cfg.concurrency, "request_rate": cfg.request_rate,
        "max_tokens": cfg.max_tokens, "completed": len(done), "failed": len(results) - len(done),
        "duration_s": duration, "output_tokens": out_tokens,
        "input_tokens": sum(r.prompt_tokens for r in done),
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "ttft_s": _pcts([r.ttft for r in done if r.ttft is not None]),
        "e2e_s": _pcts([r.e2e for r in done]),
        "itl_s": _pcts([g for r in done for g in r.itl]),
        # Time per output token after the first, per request: (e2e - TTFT) / (output tokens - 1), the
        # TPOT of vLLM's and SGLang's serving benchmarks (theirs ends at the last token, ours at [DONE]).
        "tpot_s": _pcts([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done
                         if r.ttft is not None and r.output_tokens > 1]),
        "per_user_tok_s": _pcts(speeds),
        "tokens_per_model": per_model,
        "handoffs": sum(r.handoffs for r in done),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


async def _one(client: httpx.AsyncClient, cfg: BenchConfig, prompt: str | list[int], seed: int,
               max_tokens: int) -> RequestResult:
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "seed": seed, **cfg.extra_body}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    res = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                routing = chunk.get("routing")
                if routing:
                    res.tokens_per_model = routing.get("tokens_per_model", {})
                    res.handoffs = routing.get("handoffs", 0)
        res.e2e = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_bench(cfg: BenchConfig, progress: bool = True) -> tuple[dict[str, Any], list[RequestResult]]:
    if not cfg.prompts:
        raise ValueError("the benchmark needs at least one prompt")
    if (cfg.concurrency is None) == (cfg.request_rate is None):
        raise ValueError("give either a concurrency (closed loop) or a request rate (Poisson), not both")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(64, (cfg.concurrency or 0) * 2))
    rng = random.Random(cfg.seed)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=cfg.timeout, limits=limits) as client:
        # Warm-up wakes the server's code paths; a few tokens do it at any output cap.
        warm = [_one(client, cfg, cfg.prompts[i % len(cfg.prompts)], 10**6 + i, min(cfg.cap(i), WARMUP_TOKENS))
                for i in range(cfg.warmup)]
        for r in await asyncio.gather(*warm):
            if not r.ok:
                raise RuntimeError(f"warm-up request failed: {r.error}")
        bar = tqdm(total=cfg.num_requests, desc="bench", unit="req", disable=not progress)
        results: list[RequestResult] = []

        async def job(i: int) -> None:
            r = await _one(client, cfg, cfg.prompts[i % len(cfg.prompts)], cfg.seed * 100_003 + i, cfg.cap(i))
            results.append(r)
            bar.update(1)

        start = time.perf_counter()
        if cfg.concurrency is not None:
            queue = iter(range(cfg.num_requests))

            async def worker() -> None:
                for i in queue:
                    await job(i)

            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        else:
            assert cfg.request_rate is not None
            tasks = []
            for i in range(cfg.num_requests):
                tasks.append(asyncio.create_task(job(i)))
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarise(cfg, results, duration), results


def write_jsonl(path: str, summary: dict[str, Any], extra: dict[str, Any] | None = None,
                results: list[RequestResult] | None = None) -> None:
    with open(path, "a") as f:
        row = {**(extra or {}), **summary}
        if results is not None:
            row["requests"] = [asdict(r) for r in results]
        f.write(json.dumps(row) + "\n")
