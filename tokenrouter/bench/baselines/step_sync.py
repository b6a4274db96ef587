"""The step-synchronous baseline: how the research codes serve token-level routing.

One global step at a time over a static batch: the small model decodes the whole batch, then the
positions its router sent up are rewritten by the large model (which keeps its own KV and catches
up on the tokens it has not seen), and only then does the next global step start. New requests wait
for the whole batch to finish (no continuous batching). The engines, KV caches and routers are ours,
so the comparison isolates the execution model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenrouter.engine.engine import Engine
from tokenrouter.engine.req import Req, ReqStatus
from tokenrouter.routing.deferral import DeferToLarge
from tokenrouter.sampling_params import SamplingParams


@dataclass
class SyncResult:
    output_tokens: int = 0
    wall_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # per request, from its batch's start
    per_user: list[float] = field(default_factory=list)  # output tokens / latency, per request
    tokens_per_model: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    writers: dict[str, list[str]] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds else 0.0


def _run_until_sampled(engine: Engine, want: set[str]) -> dict[str, int]:
    """Step `engine` until every request in `want` has sampled once; their tokens (not committed)."""
    got: dict[str, int] = {}
    while want - set(got):
        out = engine.forward_step()
        if out is None:
            raise RuntimeError("the engine stopped with requests outstanding")
        for req, tok in zip(out.reqs, out.token_ids):
            got[req.rid] = tok
    return got


def run_step_sync(small: Engine, large: Engine, router: DeferToLarge, prompts: list[list[int]],
                  params: SamplingParams | Sequence[SamplingParams], concurrency: int, seed: int = 0) -> SyncResult:
    """Serve `prompts` in static batches of `concurrency`, routing with `router` (route() on the small
    model's step; the large model writes exactly one token per routed position). `params`: one for
    every request, or one per request."""
    per_req = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_req) != len(prompts):
        raise ValueError(f"{len(per_req)} sampling params for {len(prompts)} prompts")
    res = SyncResult(tokens_per_model={router.small: 0, router.large: 0})
    start = time.perf_counter()
    for b0 in range(0, len(prompts), concurrency):
        batch_start = time.perf_counter()
        live: dict[str, Req] = {}
        for i, ids in enumerate(prompts[b0:b0 + concurrency], start=b0):
            rid = f"sync-{i}"
            live[rid] = small.add_request(ids, per_req[i], rid=rid, seed=seed + i)
            router.start(live[rid], {})  # the request lifecycle (RoutingAlgorithm): the group's parameters
            res.outputs[rid], res.writers[rid] = [], []
        while live:
            out = small.forward_step()
            if out is None:
                raise RuntimeError("the small model stopped with requests outstanding")
            routes = router.route(router.small, out) if out.reqs else []
            now = time.monotonic()
            sent: list[Req] = []
            for i, (req, tok, route) in enumerate(zip(out.reqs, out.token_ids, routes)):
                if route.dest is None:
                    small.append_token(req, tok, now, out, i)
                    res.outputs[req.rid].append(tok)
                    res.writers[req.rid].append(router.small)
                else:
                    small.scheduler.set_pending(req)
                    sent.append(req)
            if sent:  # the global barrier: the large model rewrites its positions before anyone goes on
                for req in sent:
                    if req.rid in large.reqs:
                        copy = large.reqs[req.rid]
                        large.receive(req.rid, len(copy.tokens), req.tokens[len(copy.tokens):])
                    else:
                        large.add_request(list(req.tokens), req.params, rid=req.rid, seed=req.seed,
                                          prompt_len=req.prompt_len)
                toks = _run_until_sampled(large, {r.rid for r in sent})
                for req in sent:
                    tok = toks[req.rid]
                    copy = large.reqs[req.rid]
                    large.append_token(copy, tok, now)
                    if copy.status is ReqStatus.RUNNING:
                        large.scheduler.set_pending(copy)
                    small.scheduler.resume(req)
                    small.append_token(req, tok, now)  # commits it and applies the stop conditions
                    res.outputs[req.rid].append(tok)
                    res.writers[req.rid].append(router.large)
            for rid in [r for r, q in live.items() if q.finished]:
                router.finish(live.pop(rid))
                if rid in large.reqs:
                    large.abort(rid)
                n = len(res.outputs[rid])
                lat = time.perf_counter() - batch_start
                res.latencies.append(lat)
                res.per_user.append(n / lat if lat > 0 else 0.0)
    res.wall_seconds = time.perf_counter() - start
    for writers in res.writers.values():
        res.output_tokens += len(writers)
        for w in writers:
            res.tokens_per_model[w] += 1
    return res
