"""The planner for three or more models (tokenrouter/planner/group_sim.py): one threshold per model."""

from __future__ import annotations

import pytest

from tokenrouter.planner.group_sim import best_group_thresholds, simulate_group

LATS = [0.01, 0.02, 0.03]
W = [0.5, 0.3, 0.2]


def test_one_request_writes_one_token_per_step_of_its_model():
    # N = 1: no waiting, no overlap; each token costs the step of the model that writes it
    r = simulate_group(1, [1, 1, 1], LATS, W, tokens=20_000)
    expected = 1.0 / sum(w * t for w, t in zip(W, LATS))
    assert r.throughput == pytest.approx(expected, rel=0.03)
    assert [c / sum(r.tokens_per_model) for c in r.tokens_per_model] == pytest.approx(W, abs=0.02)


def test_catch_up_cost_and_interference_slow_the_group():
    base = simulate_group(4, [1, 1, 1], LATS, W, tokens=10_000).throughput
    assert simulate_group(4, [1, 1, 1], LATS, W, token_cost=[0.0, 0.002, 0.002], tokens=10_000).throughput < 0.97 * base
    frozen = [[0, 1, 1], [0, 0, 1], [0, 0, 0]]  # a larger model's step stops a smaller one's
    assert simulate_group(4, [1, 1, 1], LATS, W, frozen, tokens=10_000).throughput < 0.9 * base


def test_thresholds_that_can_deadlock_are_refused():
    with pytest.raises(ValueError, match="deadlock"):
        simulate_group(4, [1, 3, 3], LATS, W)
    with pytest.raises(ValueError, match="1..N"):
        simulate_group(4, [1, 5, 1], LATS, W)


def test_co_located_waiting_pays_and_the_search_finds_it():
    frozen = [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    choice, results = best_group_thresholds(8, LATS, W, frozen, b_max=3, tokens=4000)
    assert all(sum(b - 1 for b in r.thresholds) <= 7 for r in results)
    by = {r.thresholds: r.throughput for r in results}
    assert by[choice] >= max(by.values()) / 1.01 - 1e-9
    assert by[choice] > 1.1 * by[(1, 1, 1)]  # eager launching pays a whole large step per hand-off
