"""A CI-sized soak (the full one: python -m tokenrouter.bench.soak --requests 2000): streaming and not,
10% disconnected at random moments, every completed request token-exact, nothing left behind."""

from __future__ import annotations

import asyncio

import pytest
from server_utils import ServerProcess

from tokenrouter.bench.soak import Reference, soak


@pytest.mark.parametrize("kind", ["routed", "preempting"])
def test_soak_ci_sized(kind, tmp_path, pair_paths):
    cfg = tmp_path / "group.yaml"
    if kind == "routed":  # hand-offs between two models, KV reserved at admission
        cfg.write_text("name: soak\nmodels:\n"
                       f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 1024, page_size: 4}}\n"
                       f"  - {{name: large, path: {pair_paths['large']}, kv_cache_tokens: 1024, page_size: 4}}\n"
                       "algorithm: {name: bernoulli, p: 0.3}\n")
    else:  # one model in a pool too small for the load: preemption and recompute
        cfg.write_text("name: soak\nmodels:\n"
                       f"  - {{name: small, path: {pair_paths['small']}, kv_cache_tokens: 160, page_size: 4}}\n"
                       "algorithm: single\n")
    paths = {"small": str(pair_paths["small"]), "large": str(pair_paths["large"])}
    ref = Reference(paths if kind == "routed" else {"small": paths["small"]})
    srv = ServerProcess(["--config", str(cfg), "--log-level", "error"])
    try:
        rep = asyncio.run(soak(srv.url, "soak", ref, srv.proc.pid, requests=120, concurrency=16, max_tokens=16,
                               vocab=256, seed=3, warmup=16, timeout=300))
    finally:
        assert srv.stop() == 0
    assert not rep.failed, rep.failed[:5]
    assert not rep.inexact, rep.inexact[:5]
    assert rep.completed + rep.disconnected == rep.sent == 120
    assert rep.disconnected > 0 and rep.checked_tokens == 16 * rep.completed
    assert rep.live_at_end == 0 and rep.kv_in_use_at_end == 0
    assert (rep.preemptions > 0) == (kind == "preempting")
