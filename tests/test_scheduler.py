"""Scheduler without a model: schedule -> commit -> append a fake token, as the engine does."""

from __future__ import annotations

import zlib

import pytest
import torch

from tokenrouter.engine.launch_policy import EagerLaunch, LaunchPolicy
from tokenrouter.engine.radix_cache import RadixCache
from tokenrouter.engine.req import Req, ReqStatus
from tokenrouter.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tokenrouter.models.kv_pool import KVPool
from tokenrouter.sampling_params import SamplingParams


def make_sched(num_pages=64, page_size=4, max_running=8, chunk=64, cache=True, launch=None):
    pool = KVPool(num_pages, page_size, num_layers=1, num_kv_heads=1, head_dim=1,
                  dtype=torch.float32, device=torch.device("cpu"))
    radix = RadixCache(pool, enabled=cache)
    cfg = SchedulerConfig(page_size=page_size, max_running_requests=max_running, chunked_prefill_size=chunk)
    return Scheduler(cfg, pool, radix, launch)


def make_req(rid, prompt, target=None, sched=None):
    req = Req(rid, list(prompt), len(prompt), params=SamplingParams(max_tokens=16), seed=0)
    req.target = target if target is not None else len(prompt) + 1  # total tokens when it finishes
    if sched is not None:
        sched.add(req)
    return req


def fake_token(req):
    """The token 'sampled' at req's next position: a pure function of (rid, position), like a seed."""
    return 10_000 + (zlib.crc32(req.rid.encode()) % 97) * 100 + len(req.tokens)


def step(sched) -> ScheduledBatch | None:
    batch = sched.schedule()
    sched.check_integrity()
    if batch is None:
        return None
    assert batch.num_tokens <= sched.cfg.chunked_prefill_size
    assert len(set(map(id, batch.reqs))) == len(batch.reqs), "a request scheduled twice"
    for req, n in zip(batch.reqs, batch.extend_lens):
        assert req.status is ReqStatus.RUNNING
        assert 1 <= n <= req.extend_len
        assert len(req.pages) * sched.cfg.page_size >= req.kv_len + n, "no room for the extend"
    sched.commit(batch)
    for req in batch.reqs:
        if req.kv_len == len(req.tokens):
            req.tokens.append(fake_token(req))
            if len(req.tokens) >= req.target:
                sched.finish(req)
    sched.check_integrity()
    return batch


def lens_of(batch, req):
    return dict(zip(map(id, batch.reqs), batch.extend_lens)).get(id(req))


def run_to_end(sched, max_steps=2000):
    batches = []
    for _ in range(max_steps):
        if not sched.has_work():
            return batches
        batches.append(step(sched))
    raise AssertionError("scheduler did not drain")


def assert_drained(sched):
    assert not sched.waiting and not sched.running
    assert sched.cache.locked_pages == 0
    assert sched.pool.num_free + sched.cache.total_pages == sched.pool.num_pages
    sched.check_integrity()


def expected_tokens(req):
    toks = list(req.tokens[:req.prompt_len])
    probe = Req(req.rid, toks, req.prompt_len, params=req.params, seed=0)
    while len(probe.tokens) < req.target:
        probe.tokens.append(fake_token(probe))
    return probe.tokens


# ---- config and queue -------------------------------------------------------------------------

def test_config_validation():
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        SchedulerConfig(page_size=4, max_running_requests=8, chunked_prefill_size=7)
    SchedulerConfig(page_size=4, max_running_requests=8, chunked_prefill_size=8)
    with pytest.raises(ValueError, match="page_size"):
        SchedulerConfig(page_size=0)
    with pytest.raises(ValueError, match="max_running_requests"):
        SchedulerConfig(max_running_requests=0)


def test_page_size_mismatch_rejected():
    pool = KVPool(8, 4, 1, 1, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="page size"):
        Scheduler(SchedulerConfig(page_size=2, max_running_requests=1, chunked_prefill_size=8),
                  pool, RadixCache(pool))


def test_add_rejects_admitted_request():
    sched = make_sched()
    req = make_req("a", [1, 2, 3], target=10, sched=sched)
    step(sched)
    assert req.status is ReqStatus.RUNNING and req.pages
    with pytest.raises(ValueError, match="WAITING"):
        sched.add(req)
    other = make_req("b", [1, 2, 3])
    other.pages = [0]
    with pytest.raises(ValueError, match="WAITING"):
        sched.add(other)
    sched.check_integrity()


def test_empty_scheduler_schedules_nothing():
    sched = make_sched()
    assert not sched.has_work()
    assert sched.schedule() is None
    assert_drained(sched)


# ---- continuous batching ----------------------------------------------------------------------

def test_single_request_prefill_then_decode():
    sched = make_sched()
    req = make_req("a", range(1, 6), target=9, sched=sched)
    b = step(sched)
    assert b.reqs == [req] and b.extend_lens == [5]
    assert req.kv_len == 5 and len(req.tokens) == 6 and req.status is ReqStatus.RUNNING
    for _ in range(3):
        b = step(sched)
        assert b.reqs == [req] and b.extend_lens == [1]
    assert req.finished and len(req.tokens) == 9
    assert req.tokens == expected_tokens(req)
    assert sched.schedule() is None
    assert_drained(sched)


def test_continuous_batching_join_and_leave():
    sched = make_sched()
    a = make_req("a", range(1, 6), target=5 + 6, sched=sched)
    b1 = step(sched)
    assert b1.reqs == [a]
    step(sched)
    b = make_req("b", range(50, 53), target=3 + 2, sched=sched)  # arrives mid-run
    b3 = step(sched)
    assert b3.reqs == [a, b] and b3.extend_lens == [1, 3]
    b4 = step(sched)
    assert b4.reqs == [a, b] and b4.extend_lens == [1, 1]
    assert b.finished  # reached 5 tokens
    assert b not in sched.running
    b5 = step(sched)
    assert b5.reqs == [a]  # the finished one left
    c = make_req("c", range(70, 72), target=4, sched=sched)
    b6 = step(sched)
    assert b6.reqs == [a, c] and b6.extend_lens == [1, 2]
    run_to_end(sched)
    for r in (a, b, c):
        assert r.finished and r.tokens == expected_tokens(r)
    assert_drained(sched)


# ---- chunked prefill --------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chunked_prefill_alone(page_size):
    sched = make_sched(num_pages=256 // page_size, page_size=page_size, max_running=4, chunk=32)
    req = make_req("long", range(1000, 1100), target=103, sched=sched)
    lens = [step(sched).extend_lens for _ in range(4)]
    assert lens == [[32], [32], [32], [4]]
    assert req.kv_len == 100 and len(req.tokens) == 101
    assert req.num_output == 1  # only the last chunk sampled a token
    assert [step(sched).extend_lens for _ in range(2)] == [[1], [1]]
    assert req.finished
    assert req.extended_tokens == 102
    assert_drained(sched)


def test_chunked_prefill_shares_budget_with_decodes():
    sched = make_sched(num_pages=64, page_size=4, max_running=4, chunk=32)
    d = make_req("dec", [1, 2], target=2 + 10, sched=sched)
    step(sched)  # d prefilled; it decodes from now on
    p = make_req("long", range(1000, 1100), target=101, sched=sched)
    seen = []
    while not p.finished:
        b = step(sched)
        assert b.num_tokens <= 32
        if not d.finished:
            assert lens_of(b, d) == 1  # the decode always runs, and first
            assert b.reqs[0] is d
        seen.append(lens_of(b, p))
    assert seen == [31, 31, 31, 7]
    run_to_end(sched)
    assert d.finished and d.tokens == expected_tokens(d)
    assert_drained(sched)


def test_budget_limits_admission_of_several_prompts():
    sched = make_sched(num_pages=64, page_size=4, max_running=4, chunk=16)
    reqs = [make_req(f"r{i}", range(100 * i, 100 * i + 10), target=12, sched=sched) for i in range(3)]
    b = step(sched)
    assert b.reqs == reqs[:2] and b.extend_lens == [10, 6]  # the second gets the rest of the budget
    b = step(sched)
    # r0 decodes first, then r1 continues its prefill, then r2 gets what is left.
    assert b.reqs == reqs and b.extend_lens == [1, 4, 10]
    run_to_end(sched)
    assert all(r.finished and r.tokens == expected_tokens(r) for r in reqs)
    assert_drained(sched)


# ---- caps -------------------------------------------------------------------------------------

def test_max_running_requests_cap():
    sched = make_sched(max_running=2, chunk=64)
    reqs = [make_req(f"r{i}", range(10 * i + 1, 10 * i + 4), target=3 + 3 + i, sched=sched) for i in range(4)]
    max_seen = 0
    order_started = []
    while sched.has_work():
        b = step(sched)
        max_seen = max(max_seen, len(b.reqs))
        assert len(sched.running) <= 2
        for r in b.reqs:
            if r.rid not in order_started:
                order_started.append(r.rid)
    assert max_seen == 2
    assert order_started == ["r0", "r1", "r2", "r3"]  # first come, first served
    assert all(r.finished and r.tokens == expected_tokens(r) for r in reqs)
    assert_drained(sched)


def test_cap_frees_a_slot_when_a_request_finishes():
    sched = make_sched(max_running=1, chunk=8)
    a = make_req("a", [1, 2, 3], target=5, sched=sched)
    b = make_req("b", [4, 5, 6], target=5, sched=sched)
    assert step(sched).reqs == [a]
    assert b.status is ReqStatus.WAITING and not b.pages
    assert step(sched).reqs == [a]
    assert a.finished
    assert step(sched).reqs == [b]
    run_to_end(sched)
    assert_drained(sched)


# ---- PENDING ----------------------------------------------------------------------------------

def test_pending_is_skipped_and_keeps_pages():
    sched = make_sched()
    a = make_req("a", range(1, 7), target=6 + 6, sched=sched)
    b = make_req("b", range(20, 24), target=4 + 6, sched=sched)
    step(sched)
    step(sched)
    pages, kv = list(a.pages), a.kv_len
    sched.set_pending(a)
    assert a.status is ReqStatus.PENDING
    for _ in range(2):
        bt = step(sched)
        assert bt.reqs == [b]
        assert a.pages == pages and a.kv_len == kv and a in sched.running
    with pytest.raises(ValueError):
        sched.set_pending(a)
    # Only the PENDING request is left: nothing is ready, nothing launches, but it stays admitted.
    run_to_end(sched)
    assert b.finished
    assert not sched.has_work()
    assert sched.schedule() is None
    assert a.pages == pages and a in sched.running
    sched.check_integrity()
    sched.resume(a)
    with pytest.raises(ValueError):
        sched.resume(a)
    bt = step(sched)
    assert bt.reqs == [a] and bt.extend_lens == [1]
    run_to_end(sched)
    assert a.finished and a.tokens == expected_tokens(a)
    assert_drained(sched)


def test_pending_can_take_a_peer_suffix_on_resume():
    """A peer appended several tokens while we were PENDING: they are fed as one extend."""
    sched = make_sched()
    a = make_req("a", range(1, 7), target=20, sched=sched)
    step(sched)
    sched.set_pending(a)
    a.tokens.extend([900, 901, 902])  # the peer's tokens
    assert step(sched) is None
    sched.resume(a)
    bt = step(sched)
    assert bt.extend_lens == [4]  # 1 own token + 3 from the peer
    assert a.kv_len == 10
    run_to_end(sched)
    assert_drained(sched)


def test_pending_request_is_never_preempted():
    # 4 pages of 2 tokens. a holds 2 pages and is PENDING; b runs out of pages and must preempt
    # itself, not a.
    sched = make_sched(num_pages=4, page_size=2, max_running=2, chunk=4, cache=False)
    a = make_req("a", [1, 2, 3], target=8, sched=sched)
    b = make_req("b", [4], target=8, sched=sched)
    step(sched)
    assert a.status is ReqStatus.RUNNING and b.status is ReqStatus.RUNNING
    sched.set_pending(a)
    a_pages = list(a.pages)
    for _ in range(10):
        step(sched)
        assert a.pages == a_pages and a.status is ReqStatus.PENDING
        if b.status is ReqStatus.WAITING:
            break
    assert b.status is ReqStatus.WAITING and b.num_preemptions == 1 and not b.pages
    assert a.num_preemptions == 0
    # b cannot come back while a holds its pages (it would leave a no room to grow).
    assert sched.schedule() is None
    assert b.status is ReqStatus.WAITING and a.pages == a_pages
    sched.resume(a)
    run_to_end(sched)
    assert a.finished and b.finished
    assert a.tokens == expected_tokens(a) and b.tokens == expected_tokens(b)
    assert_drained(sched)


def test_finish_pending_and_waiting_requests():
    sched = make_sched(max_running=1, chunk=8)
    a = make_req("a", range(1, 7), target=30, sched=sched)
    w = make_req("w", [1, 2], target=4, sched=sched)
    step(sched)
    sched.set_pending(a)
    sched.finish(w)  # aborted while waiting
    assert w.finished and not w.pages and w not in sched.waiting
    sched.finish(a)  # aborted while PENDING
    assert a.finished and not a.pages and a.cache_node is None
    assert_drained(sched)


# ---- preemption -------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_preemption_when_pool_runs_out(cache, shared_prefix):
    # 12 pages of 2 tokens = 24 slots; five requests that grow to 12 tokens (6 pages) each.
    sched = make_sched(num_pages=12, page_size=2, max_running=8, chunk=16, cache=cache)
    reqs = []
    for i in range(5):
        prompt = ([7, 7, 7, 7] if shared_prefix else []) + [100 * i + j for j in range(3 + i % 2)]
        reqs.append(make_req(f"r{i}", prompt, target=12, sched=sched))
    batches = run_to_end(sched, max_steps=500)
    assert sched.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    for r in reqs:
        assert r.finished
        assert len(r.tokens) == 12
        assert r.tokens == expected_tokens(r)  # recompute after preemption kept every token
    preempted = [r for r in reqs if r.num_preemptions]
    assert preempted
    if not cache:
        # Without a prefix cache a preempted request recomputes all it had.
        assert all(r.extended_tokens > len(r.tokens) - 1 for r in preempted)
    assert all(b is not None for b in batches)
    assert_drained(sched)


def test_preemption_picks_newest_and_requeues_at_head():
    # 6 pages of 2 tokens; a and b grow to 11 KV tokens (6 pages) each; c waits for room.
    sched = make_sched(num_pages=6, page_size=2, max_running=4, chunk=8, cache=False)
    a = make_req("a", [1, 2, 3], target=12, sched=sched)
    b = make_req("b", [4, 5, 6], target=12, sched=sched)
    c = make_req("c", [7, 8, 9], target=6, sched=sched)
    bt = step(sched)
    assert bt.reqs == [a, b]  # c is held back: the running requests need room to grow
    assert list(sched.waiting) == [c]
    while sched.num_preemptions == 0:
        step(sched)
    # The newer running request goes, and it goes back to the head of the queue, ahead of c.
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.status is ReqStatus.WAITING and not b.pages and b.kv_len == 0
    assert list(sched.waiting) == [b, c]
    assert sched.running == [a]
    run_to_end(sched)
    assert a.finished and b.finished and c.finished
    for r in (a, b, c):
        assert r.tokens == expected_tokens(r)
    # b recomputed the tokens it had: more extended tokens than it has KV for.
    assert b.extended_tokens > len(b.tokens) - 1
    assert_drained(sched)


def test_prompt_larger_than_pool_raises():
    sched = make_sched(num_pages=4, page_size=4, max_running=1, chunk=64)
    make_req("big", range(1, 30), target=31, sched=sched)
    with pytest.raises(RuntimeError, match="KV pool too small"):
        sched.schedule()
    assert sched.pool.num_free == 4
    sched.check_integrity()


@pytest.mark.parametrize("cache", [True, False])
def test_prompt_larger_than_pool_with_chunking_raises(cache):
    # The first chunks fit, then the request cannot grow: it must fail, not spin forever.
    sched = make_sched(num_pages=8, page_size=4, max_running=1, chunk=16, cache=cache)
    make_req("big", range(1, 41), target=42, sched=sched)
    try:
        for _ in range(50):
            step(sched)
    except RuntimeError as e:
        assert "KV pool too small" in str(e)
    else:
        raise AssertionError("a request larger than the KV pool was rescheduled forever")


def test_prefix_sharing_after_finish():
    sched = make_sched(num_pages=64, page_size=4)
    prompt = list(range(1, 21))  # 20 tokens = 5 pages
    a = make_req("a", prompt, target=22, sched=sched)
    run_to_end(sched)
    assert a.finished
    assert sched.cache.total_pages == 5  # kv_len 21 -> 5 whole pages cached

    b = make_req("b", prompt[:16] + [500, 501, 502, 503, 504], target=23, sched=sched)
    bt = step(sched)
    assert b.prefix_hit_tokens == 16
    assert bt.extend_lens == [5]  # only the new tokens run
    assert b.pages[:4] == sched.cache.match_prefix(prompt[:16]).pages
    assert b.cached_len == 16
    assert sched.cache.locked_pages == 4
    run_to_end(sched)
    assert b.extended_tokens == 5 + 1
    assert_drained(sched)

    # The same prompt again: the last token always runs, so the hit stops at the last whole page
    # before it (19 usable tokens -> 16).
    c = make_req("c", prompt, target=21, sched=sched)
    bt = step(sched)
    assert c.prefix_hit_tokens == 16 and bt.extend_lens == [4]
    run_to_end(sched)
    assert_drained(sched)


def test_prefix_sharing_between_concurrent_requests():
    sched = make_sched(num_pages=64, page_size=4)
    stem = list(range(1, 13))
    a = make_req("a", stem + [50], target=20, sched=sched)
    step(sched)
    # The cache is filled on release only: a running request does not share yet.
    b = make_req("b", stem + [60], target=20, sched=sched)
    step(sched)
    assert b.prefix_hit_tokens == 0
    sched.finish(b)  # b's prefix (12 tokens, 3 pages) goes into the cache
    assert sched.cache.total_pages == 3
    c = make_req("c", stem + [70, 71], target=20, sched=sched)
    bt = step(sched)
    assert c.prefix_hit_tokens == 12 and lens_of(bt, c) == 2
    assert sched.cache.locked_pages == 3
    step(sched)
    assert a.kv_len == 16
    # a finishes: its own copy of the stem is a duplicate and is freed, not cached twice.
    free = sched.pool.num_free
    sched.finish(a)
    assert sched.cache.total_pages == 3 + 1  # a adds only its 4th page (tokens 12..15)
    assert sched.pool.num_free == free + 3  # a's 3 duplicate stem pages went back to the pool
    sched.check_integrity()
    run_to_end(sched)
    assert_drained(sched)


def test_no_prefix_sharing_when_cache_disabled():
    sched = make_sched(cache=False)
    prompt = list(range(1, 21))
    make_req("a", prompt, target=22, sched=sched)
    run_to_end(sched)
    assert sched.cache.total_pages == 0 and sched.pool.num_free == sched.pool.num_pages
    b = make_req("b", prompt, target=22, sched=sched)
    assert step(sched).extend_lens == [20] and b.prefix_hit_tokens == 0
    run_to_end(sched)
    assert_drained(sched)


def test_finish_releases_everything_many_requests():
    sched = make_sched(num_pages=40, page_size=4, max_running=6, chunk=24)
    reqs = []
    for i in range(12):
        prompt = [1, 2, 3, 4, 5, 6, 7, 8][: (i % 3) * 4] + [100 + i] * (3 + i % 5)
        reqs.append(make_req(f"r{i}", prompt, target=len(prompt) + 3 + i % 4, sched=sched))
    run_to_end(sched)
    assert all(r.finished for r in reqs)
    assert all(not r.pages and r.cache_node is None and r.kv_len == 0 for r in reqs)
    assert any(r.prefix_hit_tokens > 0 for r in reqs)
    assert_drained(sched)
    sched.cache.reset()
    assert sched.pool.num_free == sched.pool.num_pages


# ---- launch policy ----------------------------------------------------------------------------

class Never(LaunchPolicy):
    def __init__(self):
        self.calls = []

    def should_launch(self, num_ready, num_active):
        self.calls.append((num_ready, num_active))
        return False


def test_launch_policy_can_hold_the_step():
    policy = Never()
    sched = make_sched(launch=policy)
    a = make_req("a", [1, 2, 3], sched=sched)
    free = sched.pool.num_free
    assert sched.schedule() is None
    assert policy.calls == [(1, 1)]
    assert sched.pool.num_free == free
    assert a.status is ReqStatus.WAITING and not a.pages and list(sched.waiting) == [a]
    sched.check_integrity()


class Recorder(EagerLaunch):
    def __init__(self):
        self.calls = []

    def should_launch(self, num_ready, num_active):
        self.calls.append((num_ready, num_active))
        return super().should_launch(num_ready, num_active)


def test_launch_policy_sees_ready_and_active_counts():
    policy = Recorder()
    sched = make_sched(launch=policy)
    a = make_req("a", [1, 2, 3], target=10, sched=sched)
    make_req("b", [4, 5, 6], target=10, sched=sched)
    step(sched)
    assert policy.calls[-1] == (2, 2)
    sched.set_pending(a)
    make_req("c", [7], target=10, sched=sched)
    step(sched)
    assert policy.calls[-1] == (2, 3)  # b and c ready; a PENDING still active
    sched.set_pending(sched.find("b"))
    sched.set_pending(sched.find("c"))
    assert sched.schedule() is None
    assert policy.calls[-1] == (0, 3)


# ---- randomized stress ------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(10))
def test_randomized_arrivals_pending_aborts_under_memory_pressure(seed):
    """Random arrivals with shared prefixes, PENDING spells (with peer tokens appended), aborts and a
    small pool: integrity after every step, and every request that is not aborted reaches its length."""
    import random

    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4])
    num_pages = 32 // page_size  # every request fits alone (<= 30 tokens), not many together
    sched = make_sched(num_pages=num_pages, page_size=page_size, max_running=rng.choice([2, 4, 8]),
                       chunk=rng.choice([8, 16]), cache=rng.random() < 0.7)
    stems = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []]
    reqs, pending_until, aborted = [], {}, set()
    n_arrivals = 20
    for t in range(600):
        if len(reqs) < n_arrivals and rng.random() < 0.5:
            i = len(reqs)
            prompt = rng.choice(stems) + [1000 + i] * rng.randrange(1, 6)
            reqs.append(make_req(f"r{i}", prompt, target=min(len(prompt) + rng.randrange(1, 20), 30), sched=sched))
        for r in list(pending_until):
            if pending_until[r] <= t:
                del pending_until[r]
                if not r.finished:
                    # A peer model generated a few tokens meanwhile (the same pure function of the
                    # position, so the final tokens stay checkable); they are fed on resume.
                    for _ in range(rng.randrange(0, 3)):
                        if len(r.tokens) + 1 < r.target:
                            r.tokens.append(fake_token(r))
                    sched.resume(r)
        running = [r for r in sched.running if r.status is ReqStatus.RUNNING and r.kv_len > 0]
        if running and rng.random() < 0.1:
            r = rng.choice(running)
            sched.set_pending(r)
            pending_until[r] = t + rng.randrange(1, 6)
        if rng.random() < 0.02 and sched.running:
            r = rng.choice(sched.running)
            pending_until.pop(r, None)
            sched.finish(r)
            aborted.add(r.rid)
        step(sched)
        if len(reqs) == n_arrivals and not sched.running and not sched.waiting:
            break
    else:
        raise AssertionError("did not finish")
    stats = (sched.num_preemptions, len(aborted), sum(r.prefix_hit_tokens > 0 for r in reqs))
    print("preemptions, aborts, prefix hits:", stats)
    assert sched.num_preemptions > 0  # the pool is small enough that every seed preempts
    for r in reqs:
        assert r.finished
        if r.rid not in aborted:
            assert r.tokens == expected_tokens(r)
    assert_drained(sched)
