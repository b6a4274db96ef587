"""Delayed batching's launch rule: thresholds, their deadlock-freedom check, and a simulation of two
real schedulers handing requests back and forth at random: no split and no thresholds stall."""

from __future__ import annotations

import random

import pytest
import torch

from tokenrouter.engine.launch_policy import EagerLaunch, ThresholdLaunch, Thresholds, check_deadlock_free
from tokenrouter.engine.radix_cache import RadixCache
from tokenrouter.engine.req import Req, ReqStatus
from tokenrouter.engine.scheduler import Scheduler, SchedulerConfig
from tokenrouter.models.kv_pool import KVPool
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams


def test_threshold_table_lookup():
    t = Thresholds({1: 1, 4: 2, 8: 5})
    assert [t(n) for n in (1, 2, 3, 4, 7, 8, 20)] == [1, 1, 1, 2, 2, 5, 5]
    assert Thresholds(6)(4) == 4  # never above the live count
    with pytest.raises(ValueError):
        Thresholds({0: 2})


def test_threshold_launch_uses_the_group_count():
    pol = ThresholdLaunch(Thresholds(4))
    assert not pol.should_launch(0, 10)
    assert not pol.should_launch(3, 10)
    assert pol.should_launch(4, 10)
    pol.group_active = 2  # everyone is here: launch with what there is
    assert pol.should_launch(2, 10)
    assert EagerLaunch().should_launch(1, 100)


def test_deadlock_check():
    check_deadlock_free({"small": Thresholds(1), "large": Thresholds({1: 1, 8: 8})}, 64)
    check_deadlock_free({"a": Thresholds({8: 3}), "b": Thresholds({8: 6})}, 64)  # 2 + 5 <= 7
    with pytest.raises(ValueError, match="deadlock at 8"):
        check_deadlock_free({"a": Thresholds({8: 5}), "b": Thresholds({8: 5})}, 64)


def test_group_config_validates_thresholds():
    models = [{"name": "small", "path": "x"}, {"name": "large", "path": "y"}]
    cfg = GroupConfig.from_dict({"models": models,
                                 "launch": {"policy": "threshold", "thresholds": {"large": {8: 5}}}})
    assert cfg.launch.thresholds["large"](8) == 5
    with pytest.raises(ValueError, match="deadlock"):
        GroupConfig.from_dict({"models": models,
                               "launch": {"policy": "threshold", "thresholds": {"small": 6, "large": 6}}})
    with pytest.raises(ValueError, match="unknown model"):
        GroupConfig.from_dict({"models": models, "launch": {"policy": "threshold", "thresholds": {"huge": 2}}})


class _Model:
    """A scheduler with its own copies of requests, as one subserver holds them."""

    def __init__(self, name: str, policy) -> None:
        pool = KVPool(256, 4, 1, 1, 1, torch.float32, torch.device("cpu"))
        self.name = name
        self.sched = Scheduler(SchedulerConfig(page_size=4, max_running_requests=64, chunked_prefill_size=512),
                               pool, RadixCache(pool), policy)
        self.copies: dict[str, Req] = {}

    def hand_in(self, rid: str, tokens: list[int], prompt_len: int) -> None:
        req = self.copies.get(rid)
        if req is None:
            req = Req(rid=rid, tokens=list(tokens), prompt_len=prompt_len, params=SamplingParams(), seed=0)
            self.copies[rid] = req
            self.sched.add(req)
            return
        self.sched.truncate(req, len(req.tokens))
        req.tokens.extend(tokens[len(req.tokens):])
        self.sched.resume(req)


def _simulate(split: int, n: int, thresholds: dict[str, Thresholds], p: float, seed: int, length: int = 12) -> int:
    rng = random.Random(seed)
    models = {m: _Model(m, ThresholdLaunch(thresholds[m]) if m in thresholds else EagerLaunch())
              for m in ("small", "large")}
    truth: dict[str, list[int]] = {}
    for i in range(n):
        rid = f"r{i}"
        truth[rid] = [1, 2, 3]
        models["small" if i < split else "large"].hand_in(rid, truth[rid], 3)
    steps = 0
    while truth:
        for m in models.values():
            m.sched.launch.group_active = len(truth)
        launched = False
        for name in rng.sample(list(models), 2):
            model, other = models[name], models["large" if name == "small" else "small"]
            batch = model.sched.schedule()
            if batch is None:
                continue
            launched = True
            steps += 1
            model.sched.commit(batch)
            for req in batch.reqs:
                if req.extend_len:
                    continue  # mid-prefill chunk
                truth[req.rid].append(len(truth[req.rid]))
                req.tokens.append(truth[req.rid][-1])
                if len(truth[req.rid]) >= length:
                    for m in models.values():
                        if req.rid in m.copies:
                            m.sched.finish(m.copies.pop(req.rid))
                    del truth[req.rid]
                elif rng.random() < p:
                    model.sched.set_pending(req)
                    other.hand_in(req.rid, truth[req.rid], 3)
        assert launched, f"stall: {len(truth)} live requests, no model launches"
        assert steps < 10_000
    for m in models.values():
        m.sched.check_integrity()
        assert m.sched.pool.num_free + m.sched.cache.total_pages == m.sched.pool.num_pages
    return steps


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_no_stall_over_every_split(n):
    tables = [
        {"large": Thresholds({k: k for k in range(1, n + 1)})},  # the large model waits for everyone
        {"large": Thresholds({1: 1, 4: 3, 8: 5})},  # planner-like table
        {"small": Thresholds({n: max(1, n // 2)}), "large": Thresholds({n: max(1, n - n // 2)})},  # both delay
    ]
    for table in tables:
        check_deadlock_free(table, n)
        for split in range(n + 1):
            for p in (0.1, 0.5, 0.9):
                _simulate(split, n, table, p, seed=split * 31 + n)


def test_pending_requests_do_not_count_as_ready():
    model = _Model("large", ThresholdLaunch(Thresholds(2)))
    model.hand_in("a", [1, 2, 3], 3)
    model.hand_in("b", [1, 2, 3], 3)
    model.sched.launch.group_active = 2
    batch = model.sched.schedule()
    assert batch is not None and len(batch.reqs) == 2
    model.sched.commit(batch)
    for r in batch.reqs:
        r.tokens.append(9)
    model.sched.set_pending(model.copies["a"])
    assert model.sched.schedule() is None  # one ready of two live: wait for the other
    assert model.copies["a"].status is ReqStatus.PENDING
