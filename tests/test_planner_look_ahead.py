"""Look-ahead in the throughput model: the simulator runs it request by request (tokenrouter/planner/sim.py
`look_ahead`), the chains take the share of hand-offs it answers (tokenrouter/planner/chain.py
`answered`), and the online planner measures that share (tokenrouter/planner/controller.py)."""

from __future__ import annotations

import pytest

from tokenrouter.planner import Overheads, best_thresholds, throughput_curve
from tokenrouter.planner.controller import PlannerController
from tokenrouter.planner.sim import simulate


def lat_s(b: int) -> float:
    return 0.010 + 0.0005 * b


def lat_l(b: int) -> float:
    return 0.030 + 0.001 * b


OV = Overheads(s_token=0.0005, l_token=0.001, s_overhead=0.001, l_overhead=0.001, handoff=0.001)


def test_nothing_is_answered_without_a_return_at_the_next_position():
    """Gaps of at least one token: every return brings S's tokens, so none is answered; with L's
    step flat in its rows and no per-token cost the rows that ride cost nothing either, and the
    system runs exactly as without look-ahead."""
    runs = [simulate(8, 1, lat_s, 0.03, 0.5, gaps={1: 1, 4: 1}, s_steps=20000, look_ahead=on, seed=3)
            for on in (False, True)]
    assert runs[1].answered == 0
    assert runs[1].throughput == runs[0].throughput and runs[1].l_tokens == runs[0].l_tokens


def test_a_row_never_launches_a_step():
    """One request: L never steps for other work while it is at S, so its row never rides and its
    immediate returns all queue as without look-ahead."""
    runs = [simulate(1, 1, lat_s, lat_l, 0.0, gaps={0: 1, 2: 1}, s_steps=20000, look_ahead=on, overheads=OV)
            for on in (False, True)]
    assert runs[1].answered == 0 and runs[1].throughput == pytest.approx(runs[0].throughput)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_answered_returns_skip_the_queue_and_the_step(alpha):
    """Half the runs return at the next position: with look-ahead many are answered (L tokens
    written without an L step), L steps less often for the same tokens, and throughput rises.
    (Fully serialised, alpha = 1, a return's row seldom rides: S is frozen while L runs, so L
    launches only as S's step ends, and the return leaves S at the same boundary as the others.)"""
    off, on = (simulate(8, 1, lat_s, lat_l, alpha, gaps={0: 1, 6: 1}, s_steps=20000, look_ahead=la, overheads=OV)
               for la in (False, True))
    assert on.answered > 0.2 * on.l_tokens
    assert on.l_steps / on.l_tokens < off.l_steps / off.l_tokens
    assert on.throughput > 1.05 * off.throughput


def test_lives_replayed_with_look_ahead():
    """Measured lives: an S visit of one step after an L visit is the return a row answers."""
    lives = [[(0, 3, 2), (1, 1, 2), (0, 1, 0), (1, 1, 0), (0, 5, 0)], [(0, 2, 1), (1, 1, 1), (0, 4, 0)]]
    off, on = (simulate(8, 1, lat_s, lat_l, 0.5, lives=lives, s_steps=20000, look_ahead=la, overheads=OV)
               for la in (False, True))
    assert off.answered == 0 < on.answered
    assert on.throughput > off.throughput


@pytest.mark.parametrize("alpha,n,b", [(0.0, 8, 1), (0.5, 8, 1), (1.0, 8, 1), (0.0, 8, 3), (0.5, 16, 2)])
def test_the_chain_with_the_answered_share_follows_the_simulator(alpha, n, b):
    """Geometric gaps with p = 0.3 (a return at the next position three times in ten): the
    continuous-time chain given the share the simulator answered predicts its throughput as
    closely as it predicts the system without look-ahead."""
    p = 0.3
    off = simulate(n, b, lat_s, lat_l, alpha, p=p, s_steps=40000, overheads=OV)
    on = simulate(n, b, lat_s, lat_l, alpha, p=p, s_steps=40000, overheads=OV, look_ahead=True)
    share = on.answered / on.l_tokens  # one-token visits: every L token is a hand-off
    err_off = throughput_curve(n, p, lat_s, lat_l, alpha, overheads=OV)[b - 1] / off.throughput - 1
    err_on = throughput_curve(n, p, lat_s, lat_l, alpha, overheads=OV, answered=share)[b - 1] / on.throughput - 1
    assert abs(err_on) < 0.06 and abs(err_on - err_off) < 0.025


def test_the_answered_share_is_checked():
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="answered share"):
            throughput_curve(4, 0.2, lat_s, lat_l, answered=bad)


def test_the_controller_counts_returns_as_visits_and_plans_with_the_answered_share():
    """With look-ahead a large-model token right after one is a request that came straight back: a
    visit with nothing to catch up on, and of those the subserver marks the ones it answered."""
    kw = dict(lat_s=lat_s, lat_l=lat_l, alpha=0.5, n_max=6, p0=0.2, min_tokens=10, min_interval=0.0,
              window=None, min_visits=2, overheads=OV)
    ctl = PlannerController("small", "large", look_ahead=True, **kw)
    # per request: S S L L S S S L L (two returns), the first of each pair of L tokens a queued visit
    for _ in range(10):
        prev, run = None, 0
        for m in ["small", "small", "large", "large", "small", "small", "small", "large", "large"]:
            ctl.observe(prev, m, run)
            run = 0 if m == "large" else run + 1
            prev = m
        ctl.answered(1)  # one of the two returns answered from a look-ahead row
    assert ctl.estimate == (pytest.approx(40 / 90), 0.0)  # 40 visits over 50 S tokens + 40 decisions to go
    assert ctl.answered_share == pytest.approx(10 / 40)
    assert ctl.catchup == pytest.approx((2 + 3) * 10 / 30)  # over the 30 visits that queued
    plain = PlannerController("small", "large", **kw)  # look-ahead off: a return is a span
    for _ in range(10):
        prev = None
        for m in ["small", "large", "large"]:
            plain.observe(prev, m, 0)
            prev = m
    assert plain.estimate[1] == pytest.approx(0.5) and plain.answered_share == 0.0
    while ctl.poll() is None and ctl._pending is not None:
        ctl._pending.result()
    p, _ = ctl.estimate
    expected = best_thresholds(6, p, lat_s, lat_l, 0.5, min_gain=0.01, answered=10 / 40,
                               overheads=Overheads(**{**OV.__dict__, "catchup": ctl.catchup}))
    assert ctl.answered_planned == pytest.approx(10 / 40) and ctl.table == expected
    ctl.close()
    plain.close()
