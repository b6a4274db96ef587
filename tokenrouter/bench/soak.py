"""Soak test: many requests (streaming and not, some disconnected at random moments) through a live
server; every completed request is checked token by token against the reference forward of the
model that wrote each token; at the end every model of the group must report no live request and
no KV page in use, and the resident memory of every server process (the entry and each subserver)
must be within 10% of its figure after warm-up. The peak number of queued requests (at the entry,
waiting for admission, and in the models' schedulers) shows how hard the KV pools were pressed.

    # the tiny random-weight pair and two configs: routed.yaml (a routed pair, 1024-token pools) and
    # preempting.yaml (one model, a 192-token pool)
    OMP_NUM_THREADS=1 .venv/bin/python -m tokenrouter.bench.soak --build-random-pair /tmp/soak
    OMP_NUM_THREADS=1 .venv/bin/python -m tokenrouter.bench.soak --config /tmp/soak/routed.yaml \
        --requests 2000 --concurrency 32 --max-tokens 24

Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import torch

RSS_BOUND = 0.10  # the bound on each process's resident-memory growth after warm-up


@dataclass
class SoakReport:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    failed: list[str] = field(default_factory=list)
    checked_tokens: int = 0
    inexact: list[str] = field(default_factory=list)
    members: list[str] = field(default_factory=list)  # the group's models, from /v1/models
    # Per model at the end; a model of the group missing here (no stats) fails the soak.
    live_at_end: dict[str, float] = field(default_factory=dict)
    kv_in_use_at_end: dict[str, float] = field(default_factory=dict)
    preemptions: float = 0
    # Admission pressure, sampled from /metrics during the run: requests waiting at the entry for KV
    # (a multi-model request reserves its KV on every model at admission), and the most waiting in the
    # models' schedulers together.
    peak_queued_at_entry: float = 0
    peak_waiting_in_models: float = 0
    metric_samples: int = 0
    # Resident memory (MB) of every process of the server tree, by role ("entry", a model's name for
    # its subserver, "pid N ..." for anything else), after warm-up and at the end.
    rss_warm_mb: dict[str, float] = field(default_factory=dict)
    rss_end_mb: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def rss_growth(self) -> dict[str, float | None]:
        """Growth after warm-up per process; None for a process gone (or new) at the end."""
        out: dict[str, float | None] = {}
        for role in sorted(set(self.rss_warm_mb) | set(self.rss_end_mb)):
            warm, end = self.rss_warm_mb.get(role), self.rss_end_mb.get(role)
            out[role] = (end - warm) / warm if warm and end is not None else None
        return out

    @property
    def leaks(self) -> list[str]:
        """Why the end state is not clean: a model missing from /metrics, live requests, pages in use."""
        out = []
        if not self.members:
            out.append("the group's members are unknown")
        for m in self.members:
            if m not in self.live_at_end or m not in self.kv_in_use_at_end:
                out.append(f"{m}: no stats in /metrics at the end")
            elif self.live_at_end[m] or self.kv_in_use_at_end[m]:
                out.append(f"{m}: {self.live_at_end[m]:g} live requests, {self.kv_in_use_at_end[m]:g} KV pages in use")
        return out

    @property
    def memory_problems(self) -> list[str]:
        roles = set(self.rss_warm_mb) | set(self.rss_end_mb)
        out = [] if {"entry", *self.members} <= roles else \
            [f"no resident-memory figure for {', '.join(sorted({'entry', *self.members} - roles))}"]
        for role, g in self.rss_growth.items():
            if g is None:
                out.append(f"{role}: {'gone at the end' if role in self.rss_warm_mb else 'new after warm-up'}")
            elif g > RSS_BOUND:
                out.append(f"{role}: resident memory +{100 * g:.1f}% after warm-up "
                           f"({self.rss_warm_mb[role]:.1f} -> {self.rss_end_mb[role]:.1f} MB)")
        return out

    @property
    def ok(self) -> bool:
        return not (self.failed or self.inexact or self.leaks or self.memory_problems)

    def summary(self) -> dict:
        return {**self.__dict__, "failed": self.failed[:10], "inexact": self.inexact[:10],
                "rss_growth": self.rss_growth, "leaks": self.leaks, "memory_problems": self.memory_problems,
                "ok": self.ok}


def _rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:  # the process is gone
        return None


def _unix_paths(pid: int) -> list[str]:
    """Paths of the unix sockets a process has bound (its ZeroMQ ipc inbox)."""
    try:
        return [c.laddr for c in psutil.Process(pid).net_connections(kind="unix") if isinstance(c.laddr, str)]
    except psutil.Error:
        return []


def _role(pid: int, root: int, members: list[str]) -> str:
    """'entry' for the server process; a subserver is named by its model (its ipc inbox is
    '<dir>/<model>-<tag>'); anything else by pid and command."""
    if pid == root:
        return "entry"
    names = "|".join(re.escape(m) for m in members)
    for path in _unix_paths(pid):
        hit = re.fullmatch(rf"({names})-[0-9a-f]{{8}}", Path(path).name) if names else None
        if hit:
            return hit.group(1)
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"pid {pid} ({'multiprocessing resource tracker' if 'resource_tracker' in cmd else cmd[:60]})"


def process_rss_mb(root: int, members: list[str]) -> dict[str, float]:
    """Resident memory of the server process and each of its descendants, by role."""
    from tokenrouter.bench.server_process import descendants

    out: dict[str, float] = {}
    for pid in [root, *descendants(root)]:
        mb = _rss_mb(pid)
        if mb is not None:
            out[_role(pid, root, members)] = mb
    return out


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


async def soak(url: str, model: str, reference: Reference | None, server_pid: int, requests: int,
               concurrency: int, max_tokens: int, vocab: int, seed: int = 0, cut_share: float = 0.1,
               warmup: int = 32, timeout: float = 3600.0, sample_every: float = 0.25) -> SoakReport:
    rng = random.Random(seed)
    rep = SoakReport()
    start = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        rep.members = list((await client.get("/v1/models")).json()["data"][0]["members"])
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

        async def watch_queues() -> None:
            """Sample the queues from /metrics until cancelled (the run bounds it)."""
            while True:
                try:
                    queued, waiting = _queues((await client.get("/metrics", timeout=30)).text)
                    rep.peak_queued_at_entry = max(rep.peak_queued_at_entry, queued)
                    rep.peak_waiting_in_models = max(rep.peak_waiting_in_models, waiting)
                    rep.metric_samples += 1
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(sample_every)

        watcher = asyncio.create_task(watch_queues())
        try:
            await asyncio.gather(*(one(i) for i in range(min(warmup, requests))))
            rep.rss_warm_mb = process_rss_mb(server_pid, rep.members)
            await asyncio.gather(*(one(i) for i in range(min(warmup, requests), requests)))
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        rep.seconds = time.monotonic() - start
        if reference is not None:
            for prompt, ids, writers, i in checks:
                bad = reference.check(prompt, ids, writers)
                rep.checked_tokens += len(ids)
                if bad is not None:
                    rep.inexact.append(f"request {i}: token {bad} is not {writers[bad]}'s greedy choice")
        deadline = time.monotonic() + 60
        while True:  # finishes and aborts are asynchronous: poll, bounded
            live, used, preempted = _engine_state((await client.get("/metrics", timeout=30)).text)
            rep.live_at_end, rep.kv_in_use_at_end, rep.preemptions = live, used, sum(preempted.values())
            if not rep.leaks or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        rep.rss_end_mb = process_rss_mb(server_pid, rep.members)
    return rep


def _samples(metrics_text: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(metrics_text) for s in fam.samples]


def _engine_state(metrics_text: str) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(live requests, KV pages in use, preemptions so far), each by model; a model whose subserver
    sent no stats is absent (the caller counts that as a failure, never as zero)."""
    live: dict[str, float] = {}
    used: dict[str, float] = {}
    preempted: dict[str, float] = {}
    for s in _samples(metrics_text):
        m = s.labels.get("model")
        if m is None:
            continue
        if s.name == "tokenrouter_model_live_requests":
            live[m] = s.value
        elif s.name == "tokenrouter_kv_pages_total":
            used[m] = used.get(m, 0.0) + s.value
        elif s.name in ("tokenrouter_kv_pages_free", "tokenrouter_kv_pages_cached"):
            used[m] = used.get(m, 0.0) - s.value
        elif s.name == "tokenrouter_model_preemptions":
            preempted[m] = s.value
    return live, used, preempted


def _queues(metrics_text: str) -> tuple[float, float]:
    """(requests waiting for admission at the entry, requests waiting in the models' schedulers)."""
    queued = waiting = 0.0
    for s in _samples(metrics_text):
        if s.name == "tokenrouter_queue_waiting":
            queued += s.value
        elif s.name == "tokenrouter_model_waiting_requests":
            waiting += s.value
    return queued, waiting


def write_configs(folder: str | Path, small: str | Path, large: str | Path, routed_kv: int = 1024,
                  preempting_kv: int = 192, p: float = 0.2) -> dict[str, Path]:
    """routed.yaml (the pair, bernoulli p, KV reserved at admission) and preempting.yaml (the small
    model alone in a pool too small for the load: preemption by recompute)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    routed, preempting = folder / "routed.yaml", folder / "preempting.yaml"
    routed.write_text("name: soak\nmodels:\n"
                      f"  - {{name: small, path: {small}, kv_cache_tokens: {routed_kv}, page_size: 4}}\n"
                      f"  - {{name: large, path: {large}, kv_cache_tokens: {routed_kv}, page_size: 4}}\n"
                      f"algorithm: {{name: bernoulli, p: {p}}}\n")
    preempting.write_text("name: soak\nmodels:\n"
                          f"  - {{name: small, path: {small}, kv_cache_tokens: {preempting_kv}, page_size: 4}}\n"
                          "algorithm: single\n")
    return {"routed": routed, "preempting": preempting}


def build_random_pair(folder: str | Path) -> dict[str, Path]:
    """The tests' tiny random-weight pair (a 2-layer 64-wide Llama and a 3-layer 128-wide one, one
    byte-level vocabulary) in folder/small and folder/large, and the two soak configs beside them."""
    from tokenrouter.models.random_model import build_random_model

    folder = Path(folder).resolve()
    small = build_random_model(folder / "small", "llama", "tiny", seed=11)
    large = build_random_model(folder / "large", "llama", "tiny", seed=12, hidden_size=128, num_hidden_layers=3,
                               intermediate_size=256)
    return {"small": small, "large": large, **write_configs(folder, small, large)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="group YAML to serve (started here on a free port)")
    ap.add_argument("--build-random-pair", metavar="DIR",
                    help="write the tiny random-weight pair and routed.yaml / preempting.yaml to DIR, then exit")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--cut-share", type=float, default=0.1, help="share of requests disconnected at random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="skip the token-exactness check")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.build_random_pair:
        for what, path in build_random_pair(args.build_random_pair).items():
            print(f"{what}: {path}")
        return 0
    if not args.config:
        ap.error("give --config (or --build-random-pair DIR to make one)")
    from tokenrouter.bench.server_process import ServerProcess
    from tokenrouter.models.config import ModelConfig
    from tokenrouter.runtime.group_config import GroupConfig

    group = GroupConfig.from_yaml(args.config)
    vocab = min(ModelConfig.from_folder(m.engine.model_path).vocab_size for m in group.models)
    ref = None if args.no_check else Reference({m.name: m.engine.model_path for m in group.models})
    srv = ServerProcess(["--config", args.config, "--log-level", "error"], startup_timeout=600)
    try:
        rep = asyncio.run(soak(srv.url, group.name, ref, srv.proc.pid, args.requests, args.concurrency,
                               args.max_tokens, vocab, args.seed, args.cut_share))
    finally:
        rc = srv.stop()
    print(json.dumps({**rep.summary(), "server_exit": rc}, indent=2))
    return 0 if rep.ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
