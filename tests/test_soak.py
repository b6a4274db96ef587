"""A CI-sized soak (the full one: python -m tokenrouter.bench.soak, see docs/RELIABILITY.md): streaming
and not, 10% disconnected at random moments, every completed request token-exact, every model of the
group reporting no live request and no KV page in use at the end, resident memory reported for every
server process, and the routed pair's KV pools under admission pressure."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_utils import ServerProcess

from tokenrouter.bench.soak import Reference, SoakReport, _engine_state, soak, write_configs


@pytest.mark.parametrize("kind", ["routed", "preempting"])
def test_soak_ci_sized(kind, tmp_path, pair_paths):
    # routed: hand-offs between two models, KV reserved at admission on both; 256-token pools hold
    # about 5 of the 16 concurrent requests, so the rest queue at the entry. preempting: one model in a
    # pool too small for the load, so its scheduler preempts and recomputes.
    cfg = write_configs(tmp_path, pair_paths["small"], pair_paths["large"], routed_kv=256, preempting_kv=160,
                        p=0.3)[kind]
    paths = {"small": str(pair_paths["small"]), "large": str(pair_paths["large"])}
    ref = Reference(paths if kind == "routed" else {"small": paths["small"]})
    srv = ServerProcess(["--config", str(cfg), "--log-level", "error"])
    try:
        rep = asyncio.run(soak(srv.url, "soak", ref, srv.proc.pid, requests=60, concurrency=16, max_tokens=16,
                               vocab=256, seed=3, warmup=16, timeout=300, sample_every=0.1))
    finally:
        assert srv.stop() == 0
    print(json.dumps({k: v for k, v in rep.summary().items() if k not in ("failed", "inexact")}))
    assert not rep.failed, rep.failed[:5]
    assert not rep.inexact, rep.inexact[:5]
    assert rep.completed + rep.disconnected == rep.sent == 60
    assert rep.disconnected > 0 and rep.checked_tokens == 16 * rep.completed
    assert rep.members == (["small", "large"] if kind == "routed" else ["small"])
    assert not rep.leaks, rep.leaks
    assert all(rep.live_at_end[m] == 0 and rep.kv_in_use_at_end[m] == 0 for m in rep.members)
    # Resident memory of the entry and of each subserver, after warm-up and at the end.
    for figures in (rep.rss_warm_mb, rep.rss_end_mb):
        assert {"entry", *rep.members} <= set(figures) and all(mb > 0 for mb in figures.values()), figures
    assert all(g is not None for g in rep.rss_growth.values()), rep.rss_growth
    # Each process within 10% of its warm figure. At this size (a few seconds) it is a weak check, though
    # a reliable one (measured growth 0.05-0.25%); the full soak is the real test of the bound.
    assert not rep.memory_problems, rep.memory_problems
    assert rep.ok
    assert rep.metric_samples > 0
    if kind == "routed":  # reservation at admission: requests wait at the entry, nothing is preempted
        assert rep.peak_queued_at_entry > 0 and rep.preemptions == 0
    else:
        assert rep.preemptions > 0


METRICS_ONE_MODEL = """\
# TYPE tokenrouter_model_live_requests gauge
tokenrouter_model_live_requests{model="small"} 0.0
# TYPE tokenrouter_kv_pages_total gauge
tokenrouter_kv_pages_total{model="small"} 64.0
# TYPE tokenrouter_kv_pages_free gauge
tokenrouter_kv_pages_free{model="small"} 60.0
# TYPE tokenrouter_kv_pages_cached gauge
tokenrouter_kv_pages_cached{model="small"} 4.0
"""


def test_end_state_needs_every_model():
    live, used, _ = _engine_state(METRICS_ONE_MODEL)
    assert live == {"small": 0.0} and used == {"small": 0.0}
    rep = SoakReport(members=["small", "large"], live_at_end=live, kv_in_use_at_end=used,
                     rss_warm_mb={"entry": 100.0, "small": 50.0, "large": 60.0},
                     rss_end_mb={"entry": 101.0, "small": 50.0, "large": 60.0})
    assert rep.leaks == ["large: no stats in /metrics at the end"] and not rep.ok
    rep.live_at_end, rep.kv_in_use_at_end = {**live, "large": 0.0}, {**used, "large": 0.0}
    assert rep.ok
    none = _engine_state("")  # no stats at all: nothing to pass on
    rep.live_at_end, rep.kv_in_use_at_end = none[0], none[1]
    assert len(rep.leaks) == 2 and not rep.ok


def test_memory_bound_is_per_process():
    rep = SoakReport(members=["small"], live_at_end={"small": 0}, kv_in_use_at_end={"small": 0},
                     rss_warm_mb={"entry": 1000.0, "small": 100.0}, rss_end_mb={"entry": 1001.0, "small": 111.0})
    assert rep.memory_problems == ["small: resident memory +11.0% after warm-up (100.0 -> 111.0 MB)"]
    assert not rep.ok  # the tree's sum grew 1.1%: a sum would have hidden it
    rep.rss_end_mb["small"] = 109.0
    assert rep.ok
    del rep.rss_end_mb["small"]
    assert rep.memory_problems == ["small: gone at the end"] and not rep.ok
    assert not SoakReport(members=["small"], live_at_end={"small": 0}, kv_in_use_at_end={"small": 0}).ok
