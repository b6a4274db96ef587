"""Soak test: many requests (streaming and not, some disconnected at random moments) through a live
server; every completed request is checked token by token against the reference forward of the
model that wrote each token; at the end no request may be live and no KV page in use, and the
servers' resident memory must be flat after warm-up.

    OMP_NUM_THREADS=1 .venv/bin/python -m tokenrouter.bench.soak --config group.yaml --requests 2000

Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch


@dataclass
class SoakReport:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    failed: list[str] = field(default_factory=list)
    checked_tokens: int = 0
    inexact: list[str] = field(default_factory=list)
    live_at_end: float = -1
    kv_in_use_at_end: float = -1
    preemptions: float = 0
    rss_warm_mb: float = 0.0
    rss_end_mb: float = 0.0
    seconds: float = 0.0

    @property
    def rss_growth(self) -> float:
        return (self.rss_end_mb - self.rss_warm_mb) / self.rss_warm_mb if self.rss_warm_mb else 0.0

    @property
    def ok(self) -> bool:
        return (not self.failed and not self.inexact and self.live_at_end == 0 and self.kv_in_use_at_end == 0
                and self.rss_growth <= 0.10)


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants (Linux /proc)."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return total


class Reference:
    """Greedy choices of each model of the group, from transformers' forward of the same weights."""

    def __init__(self, paths: dict[str, str]) -> None:
        from transformers import AutoModelForCausalLM

        self.models = {n: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for n, p in paths.items()}

    @torch.no_grad()
    def check(self, prompt: list[int], tokens: list[int], writers: list[str], tie: float = 1e-5) -> int | None:
        """Index of the first token that is not its writer's greedy choice, or None."""
        seq = torch.tensor([prompt + tokens])
        logits = {n: m(input_ids=seq).logits[0] for n, m in self.models.items() if n in writers}
        for j, (tok, w) in enumerate(zip(tokens, writers)):
            row = logits[w][len(prompt) + j - 1]
            top2 = row.topk(2).values
            if (top2[0] - top2[1]).item() >= tie and tok != int(row.argmax()):
                return j
        return None


async def _request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, seed: int,
                   stream: bool, cut_after: int | None) -> tuple[str, list[int], list[str]]:
    """('done' | 'cut', token ids, writers). cut_after: disconnect after that many chunks (stream) or
    that many milliseconds (not streaming)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": seed,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if not stream:
        call = client.post("/v1/completions", json=body)
        try:
            r = await (asyncio.wait_for(call, cut_after / 1000) if cut_after is not None else call)
        except asyncio.TimeoutError:
            return "cut", [], []  # the client gave up: the server must abort the request
        r.raise_for_status()
        data = r.json()
        return "done", data["choices"][0]["token_ids"], data["routing"]["token_models"]
    ids: list[int] = []
    writers: list[str] = []
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                raise RuntimeError(data["error"]["message"])
            ids.extend(data["choices"][0].get("token_ids", []))
            if "routing" in data:
                writers = data["routing"].get("token_models", [])
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                return "cut", [], []
    return "done", ids, writers


async def soak(url: str, model: str, reference: Reference | None, server_pid: int | None, requests: int,
               concurrency: int, max_tokens: int, vocab: int, seed: int = 0, cut_share: float = 0.1,
               warmup: int = 32, timeout: float = 3600.0) -> SoakReport:
    rng = random.Random(seed)
    rep = SoakReport()
    start = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)
        checks: list[tuple[list[int], list[int], list[str], int]] = []

        async def one(i: int) -> None:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            stream = rng.random() < 0.5
            cut = None
            if rng.random() < cut_share:
                cut = rng.randint(1, max_tokens) if stream else rng.randint(1, 200)
            async with sem:
                if time.monotonic() - start > timeout:
                    rep.failed.append(f"request {i}: soak time limit reached")
                    return
                rep.sent += 1
                try:
                    status, ids, writers = await _request(client, model, prompt, max_tokens, seed * 100_000 + i,
                                                          stream, cut)
                except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
                    rep.failed.append(f"request {i}: {type(e).__name__}: {e}")
                    return
            if status == "cut":
                rep.disconnected += 1
            elif status == "done":
                rep.completed += 1
                if len(ids) != max_tokens or len(writers) != len(ids):
                    rep.failed.append(f"request {i}: {len(ids)} tokens, {len(writers)} writers")
                else:
                    checks.append((prompt, ids, writers, i))

        await asyncio.gather(*(one(i) for i in range(min(warmup, requests))))
        if server_pid is not None:
            rep.rss_warm_mb = tree_rss_mb(server_pid)
        await asyncio.gather(*(one(i) for i in range(min(warmup, requests), requests)))
        rep.seconds = time.monotonic() - start
        if reference is not None:
            for prompt, ids, writers, i in checks:
                bad = reference.check(prompt, ids, writers)
                rep.checked_tokens += len(ids)
                if bad is not None:
                    rep.inexact.append(f"request {i}: token {bad} is not {writers[bad]}'s greedy choice")
        deadline = time.monotonic() + 60
        while True:  # finishes and aborts are asynchronous: poll, bounded
            live, used, preempted = _engine_state(httpx.get(url + "/metrics", timeout=30).text)
            if (live == 0 and used == 0) or time.monotonic() > deadline:
                rep.live_at_end, rep.kv_in_use_at_end, rep.preemptions = live, used, preempted
                break
            await asyncio.sleep(0.2)
        if server_pid is not None:
            rep.rss_end_mb = tree_rss_mb(server_pid)
    return rep


def _engine_state(metrics_text: str) -> tuple[float, float, float]:
    """(live requests, KV pages in use, preemptions so far), summed over the models."""
    from prometheus_client.parser import text_string_to_metric_families

    live = used = preempted = 0.0
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "tokenrouter_model_live_requests":
                live += s.value
            elif s.name == "tokenrouter_kv_pages_total":
                used += s.value
            elif s.name in ("tokenrouter_kv_pages_free", "tokenrouter_kv_pages_cached"):
                used -= s.value
            elif s.name == "tokenrouter_model_preemptions":
                preempted += s.value
    return live, used, preempted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="group YAML to serve (started here on a free port)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--cut-share", type=float, default=0.1, help="share of requests disconnected at random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="skip the token-exactness check")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from tokenrouter.bench.server_process import ServerProcess
    from tokenrouter.group_config import GroupConfig
    from tokenrouter.models.config import ModelConfig

    group = GroupConfig.from_yaml(args.config)
    vocab = min(ModelConfig.from_folder(m.path).vocab_size for m in group.models)
    ref = None if args.no_check else Reference({m.name: m.path for m in group.models})
    srv = ServerProcess(["--config", args.config, "--log-level", "error"], startup_timeout=600)
    try:
        rep = asyncio.run(soak(srv.url, group.name, ref, srv.proc.pid, args.requests, args.concurrency,
                               args.max_tokens, vocab, args.seed, args.cut_share))
    finally:
        rc = srv.stop()
    print(json.dumps({**rep.__dict__, "failed": rep.failed[:10], "inexact": rep.inexact[:10],
                      "rss_growth": rep.rss_growth, "server_exit": rc, "ok": rep.ok}, indent=2))
    return 0 if rep.ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
