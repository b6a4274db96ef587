"""The continuous-time throughput model (tokenrouter.planner.continuous) and the runtime's costs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenrouter.planner import Overheads, best_thresholds, plan, throughput_curve, zero_wait_bound
from tokenrouter.planner.continuous import continuous_curve, solve_continuous
from tokenrouter.planner.sim import simulate

LAT_S, LAT_L = 0.012, (0.026, 0.0004)  # the paper profile's latencies (seconds)


@pytest.mark.parametrize("alpha,B,handoff", [(0.0, 1, 0.0), (0.0, 3, 0.001), (0.5, 2, 0.0), (1.0, 1, 0.001),
                                             (1.0, 4, 0.0)])
def test_matches_the_continuous_time_simulator(alpha, B, handoff):
    """The simulator runs the runtime's timing event by event: S never waits for L's return to start
    a step, returns wait for S's step in progress, hand-offs reach L after `handoff` seconds."""
    exact = solve_continuous(8, B, 0.1, LAT_S, LAT_L, alpha, handoff=handoff, grid=16).throughput
    sim = simulate(8, B, LAT_S, LAT_L, alpha, p=0.1, handoff=handoff, s_steps=30000, seed=2)
    assert abs(sim.throughput - exact) < max(4 * sim.stderr, 0.01 * exact)


def test_equals_the_aligned_chain_when_l_steps_are_whole_s_steps():
    """Separate devices, r = 4, no hand-off latency: L launches and returns on S's boundaries, so
    nothing waits and the two chains describe the same system."""
    aligned = throughput_curve(8, 0.15, 1.0, 4.0, 0.0)
    cont = [s.throughput for s in continuous_curve(8, 0.15, 1.0, 4.0, 0.0)]
    assert np.allclose(cont, aligned, rtol=1e-9)


def test_returns_wait_for_the_s_step_in_progress():
    # one request: S is empty while L runs, so the return starts a step at once
    one = solve_continuous(1, 1, 0.2, 1.0, 3.0, 1.0).throughput
    assert one == pytest.approx(5.0 / (5.0 + 3.0))  # per cycle 5 S steps (4 tokens kept) + one L step
    # more: co-located, a return waits for the S step L froze; the aligned chain lets it rejoin at once
    aligned = throughput_curve(4, 0.2, 1.0, 3.0, 1.0)
    cont = throughput_curve(4, 0.2, 1.0, 3.0, 1.0, overheads=Overheads())
    assert (cont < aligned).all()


def test_one_request_with_hand_off_latency_is_exact():
    p, t_s, t_l, h = 0.25, 0.01, 0.03, 0.002
    thr = solve_continuous(1, 1, p, t_s, t_l, 0.0, handoff=h).throughput
    assert thr == pytest.approx((1 / p) / (t_s / p + h + t_l))  # 1/p tokens per cycle


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_solutions_are_consistent(alpha):
    sols = continuous_curve(6, 0.2, LAT_S, LAT_L, alpha, handoff=0.001)
    bound = zero_wait_bound(6, 0.2, LAT_S, LAT_L)
    for B, s in enumerate(sols, start=1):
        assert s.b == B and 0 < s.throughput <= bound
        assert 0 < s.l_throughput < s.throughput and 0 < s.l_busy <= 1.0
        assert B <= s.mean_l_batch <= 6
    # nothing routed: S alone, N / t_S
    assert solve_continuous(6, 2, 0.0, LAT_S, LAT_L, alpha).throughput == pytest.approx(6 / LAT_S)


def test_runtime_latencies_add_catch_up_tokens_and_overheads():
    rt = Overheads(s_token=1e-5, l_token=2e-4, s_overhead=8e-4, l_overhead=9e-4, handoff=1e-3)
    t_s, t_l = rt.step_latencies(LAT_S, LAT_L, 0.1)
    assert t_s(4) == pytest.approx(0.012 + 8e-4)  # one-token visits to L: S gets one token back
    assert t_l(4) == pytest.approx(0.026 + 0.0016 + 9e-4 + 2e-4 * 9 * 4)  # 9 = (1 - p) / p catch-up tokens
    t_s, _ = rt.step_latencies(LAT_S, LAT_L, 0.1, q_l=0.5)
    assert t_s(4) == pytest.approx(0.012 + 8e-4 + 1e-5 * 0.1 * 1.0 * 4)  # spans of 2: one extra token
    with pytest.raises(ValueError, match="handoff"):
        Overheads(handoff=-1.0)
    # A measured catch-up (runs cut by the request's end never reach L) replaces the geometric 9 tokens.
    measured = Overheads(l_token=2e-4, l_overhead=9e-4, catchup=3.5)
    assert measured.step_latencies(LAT_S, LAT_L, 0.1)[1](4) == pytest.approx(0.026 + 0.0016 + 9e-4 + 2e-4 * 3.5 * 4)
    with pytest.raises(ValueError, match="catchup must be >= 0 tokens"):
        Overheads(catchup=-1.0)


def test_planning_with_a_runtime():
    rt = Overheads(l_token=2e-4, s_overhead=8e-4, l_overhead=9e-4, handoff=1e-3)
    curve = throughput_curve(8, 0.1, LAT_S, LAT_L, 1.0, overheads=rt)
    assert (curve < throughput_curve(8, 0.1, LAT_S, LAT_L, 1.0)).all()  # the runtime only costs time
    table = best_thresholds(8, 0.1, LAT_S, LAT_L, 1.0, overheads=rt, min_gain=0.01)
    assert sorted(table) == list(range(1, 9)) and table[1] == 1
    assert curve[table[8] - 1] >= curve.max() / 1.01  # within the 1% it was allowed
    row = plan([8], 0.1, LAT_S, LAT_L, 1.0, overheads=rt)[0]
    assert row.throughput == pytest.approx(list(curve)) and row.best_b == int(np.argmax(curve)) + 1
    with pytest.raises(ValueError, match="q_L = 0"):
        throughput_curve(8, 0.1, LAT_S, LAT_L, 1.0, q_l=0.3, overheads=rt)


def test_bad_inputs():
    with pytest.raises(ValueError, match="below the S step"):
        solve_continuous(4, 1, 0.1, LAT_S, LAT_L, handoff=0.02)
    with pytest.raises(ValueError, match="threshold B"):
        solve_continuous(4, 5, 0.1, LAT_S, LAT_L)
    with pytest.raises(ValueError, match="grid"):
        solve_continuous(4, 1, 0.1, LAT_S, LAT_L, grid=0)


def test_cli_runtime_options(capsys):
    from tokenrouter.planner.cli import main

    assert main(["--n", "4", "--p", "0.1", "--lat-s", "0.012", "--lat-l", "0.026,0.0004", "--alpha", "1",
                 "--handoff", "0.001", "--overhead-s", "0.0007", "--token-l", "0.0002", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overheads"]["handoff"] == 0.001 and out["overheads"]["l_overhead"] == 0.0
    rt = Overheads(handoff=0.001, s_overhead=0.0007, l_token=0.0002)
    expected = list(throughput_curve(4, 0.1, LAT_S, LAT_L, 1.0, overheads=rt))
    assert out["rows"][0]["throughput"] == pytest.approx(expected)
    # a measured catch-up per visit (3 tokens, not the geometric 9) plans a cheaper L
    assert main(["--n", "4", "--p", "0.1", "--lat-s", "0.012", "--lat-l", "0.026,0.0004", "--alpha", "1",
                 "--token-l", "0.0002", "--catchup", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    short = list(throughput_curve(4, 0.1, LAT_S, LAT_L, 1.0, overheads=Overheads(l_token=0.0002, catchup=3.0)))
    assert out["overheads"]["catchup"] == 3.0 and out["rows"][0]["throughput"] == pytest.approx(short)
    assert short[0] > throughput_curve(4, 0.1, LAT_S, LAT_L, 1.0, overheads=Overheads(l_token=0.0002))[0]
    assert main(["--n", "4", "--p", "0.1", "--r", "4", "--continuous", "--method", "full"]) == 2
