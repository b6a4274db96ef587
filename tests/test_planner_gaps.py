"""Run lengths between sends against the geometric assumption (tokenrouter/planner/gaps.py), the
runs read off a step trace (tokenrouter/bench/trace_reader.py), and the simulator's runtime costs and
inter-token latencies (tokenrouter/planner/sim.py)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from tokenrouter.bench.trace_reader import Step, latency_ratio, request_legs, send_runs, visit_runs
from tokenrouter.planner import Overheads, controller, throughput_curve
from tokenrouter.planner.chain import best_thresholds
from tokenrouter.planner.controller import PlannerController
from tokenrouter.planner.gaps import fit_runs, hazard
from tokenrouter.planner.sim import simulate


def test_hazard_counts_censored_runs_as_surviving_all_but_their_last_step():
    n, d = hazard([1, 3], [3])
    # at risk: step 1 all three; step 2 the sent 3 and the cut 3; step 3 only the sent 3
    assert n.tolist() == [3, 2, 1] and d.tolist() == [1, 0, 1]


def test_geometric_runs_fit_and_pass_with_independent_censoring():
    rng = np.random.default_rng(1)
    k = rng.geometric(0.1, 20_000)
    c = rng.integers(1, 60, 20_000)  # censoring independent of the run
    fit = fit_runs(k[k <= c], c[k > c])
    assert fit.p == pytest.approx(0.1, rel=0.03)
    assert fit.p_value > 0.01 and fit.ks < 0.02
    assert fit.mean_steps == pytest.approx(10, rel=0.05)
    assert sum(fit.gap_histogram().values()) == pytest.approx(1.0)
    assert min(fit.gap_histogram()) == 0  # a run of one step keeps no token


def test_bursty_runs_are_rejected():
    rng = np.random.default_rng(2)
    k = np.where(rng.random(2000) < 0.5, 1, 19)  # mean 10, as geometric p = 0.1
    fit = fit_runs(k)
    assert fit.p == pytest.approx(0.1, rel=0.05)
    assert fit.p_value < 1e-6 and fit.ks > 0.3
    assert fit.gap_histogram() == pytest.approx({0: np.mean(k == 1), 18: np.mean(k == 19)})


def test_bad_runs():
    with pytest.raises(ValueError, match=">= 1"):
        fit_runs([0, 2])
    with pytest.raises(ValueError, match="nothing to fit"):
        fit_runs([], [3])


def test_runs_from_a_trace():
    steps = [Step(0, 0, 1, ["a", "b"], [4, 4]), Step(0, 1, 2, ["a", "b"], [1, 1]),  # a sends after 2
             Step(1, 2, 3, ["a"], [3]), Step(0, 3, 4, ["a", "b"], [1, 1]),  # b runs on: cut at its end
             Step(0, 4, 5, ["a"], [1])]
    # fed: what each visit's first step computed beyond one token (the prompt, then the catch-up)
    assert visit_runs(steps) == {"a": [(0, 2, 3), (1, 1, 2), (0, 2, 0)], "b": [(0, 3, 3)]}
    runs = send_runs(steps, 0)
    assert runs.sent == [2] and sorted(runs.cut) == [2, 3]
    assert send_runs(steps, 1).sent == [1]
    # measured over modelled seconds, leaving out the S steps that overlap an L step
    flat = lambda b, tokens: 0.5  # noqa: E731
    assert latency_ratio(steps, 0, flat) == pytest.approx(2.0)
    steps[2] = Step(1, 2.5, 3.5, ["a"], [3])  # overlaps S's step at 3..4
    assert latency_ratio(steps, 0, flat, apart_from=1) == pytest.approx(2.0)
    assert latency_ratio(steps, 0, lambda b, tokens: 0.25 * tokens, apart_from=1) == pytest.approx(3 / (0.25 * 11))


def test_simulator_charges_the_runtime_like_the_continuous_chain():
    ov = Overheads(s_token=2e-5, l_token=2e-4, s_overhead=7e-4, l_overhead=9e-4, handoff=1e-3)
    lat_l = (0.026, 0.0004)
    exact = throughput_curve(8, 0.1, 0.012, lat_l, 1.0, overheads=ov)[2]
    sim = simulate(8, 3, 0.012, lat_l, 1.0, p=0.1, overheads=ov, s_steps=30_000)
    assert abs(sim.throughput - exact) < 4 * sim.stderr + 0.005 * exact
    plain = simulate(8, 3, 0.012, lat_l, 1.0, p=0.1, s_steps=30_000)
    assert plain.throughput > sim.throughput * 1.05  # the costs matter


def test_simulator_inter_token_latency():
    # one request, S only (p = 0): every token one S step apart
    r = simulate(1, 1, 0.01, 0.03, 0.0, p=0.0, s_steps=2000)
    assert r.itl_percentile(50) == pytest.approx(0.01) and r.itl_percentile(99) == pytest.approx(0.01)
    # co-located, a hand-off stops S for an L step: the tail holds L's step on top of S's
    r = simulate(4, 1, 0.01, 0.03, 1.0, p=0.02, s_steps=20_000)
    assert r.itl_percentile(50) == pytest.approx(0.01, rel=0.01)
    assert r.itl_percentile(99) >= 0.04 - 1e-9


def test_simulator_replays_measured_lives_whole():
    # One request at a time: 3 S steps (the last one's token dropped: it sends), one L token fed the 2
    # tokens S kept, then a last S visit of 5 steps that ends the request with every token kept (no
    # send, no catch-up): 8 tokens in 8 S steps and one L step, exactly.
    life = [(0, 3), (1, 1), (0, 5)]
    ov = Overheads(l_token=0.004)
    r = simulate(1, 1, 0.01, 0.05, 0.0, lives=[life], overheads=ov, s_steps=8_000)
    assert r.throughput == pytest.approx(8 / (8 * 0.01 + 0.05 + 2 * 0.004), rel=0.002)
    assert r.l_tokens / (r.s_tokens + r.l_tokens) == pytest.approx(1 / 8, abs=0.002)
    # the same runs drawn one by one (both end in a send) put every fourth token on L, not every eighth
    drawn = simulate(1, 1, 0.01, 0.05, 0.0, gaps={2: 1, 4: 1}, overheads=ov, s_steps=8_000)
    assert drawn.l_tokens / (drawn.s_tokens + drawn.l_tokens) == pytest.approx(1 / 4, abs=0.005)
    # a life that ends on L, with spans of two and three tokens: S 2 + L 2 + S 3 + L 3 = 10 tokens in
    # 7 S steps and 5 L steps; L feeds 2 then 3 tokens; S takes back one extra token after the span of 2
    ends_on_l = [(0, 3), (1, 2), (0, 4), (1, 3)]
    costs = Overheads(l_token=0.004, s_token=0.002)
    e = simulate(1, 1, 0.01, 0.05, 0.0, lives=[ends_on_l], overheads=costs, s_steps=7_000)
    assert e.throughput == pytest.approx(10 / (7 * 0.01 + 5 * 0.05 + (2 + 3) * 0.004 + 0.002), rel=0.002)
    assert e.l_tokens / (e.s_tokens + e.l_tokens) == pytest.approx(0.5, abs=0.002)
    assert e.l_steps / e.s_steps == pytest.approx(5 / 7, rel=0.005)
    # no gap between two requests' tokens counts: the longest is a send (S step, L step fed 3 tokens)
    assert e.itl.max() == pytest.approx(0.01 + 0.05 + 3 * 0.004)
    assert len(e.itl) / (e.s_tokens + e.l_tokens) == pytest.approx(0.9, abs=0.002)
    # with what each visit fed, as measured, the steps are charged that instead: L is fed 7 tokens
    # (its prefix cache held none of the prompt), S's first step 10 (the prompt), S after L nothing
    fed = simulate(1, 1, 0.01, 0.05, 0.0, lives=[[(0, 3, 10), (1, 1, 7), (0, 5, 0)]], overheads=costs,
                   s_steps=8_000)
    assert fed.throughput == pytest.approx(8 / (8 * 0.01 + 0.05 + 7 * 0.004 + 10 * 0.002), rel=0.002)
    assert fed.l_fed == 7.0
    # a first visit that L's prefix cache mostly held feeds it less than the gap S wrote; S's second
    # visit is charged the 3 tokens it was fed, not the span's one beyond the first
    cached = simulate(1, 1, 0.01, 0.05, 0.0, lives=[[(0, 3, 0), (1, 2, 0), (0, 4, 3), (1, 3, 3)]],
                      overheads=costs, s_steps=7_000)
    assert cached.throughput == pytest.approx(10 / (7 * 0.01 + 5 * 0.05 + 3 * 0.004 + 3 * 0.002), rel=0.002)
    assert cached.l_fed == pytest.approx(3 / 5)  # L's two visits fed 0 and 3 tokens over 5 L steps
    # the mean batches it reports: with B = N every L step takes all four requests
    full = simulate(4, 4, 0.01, 0.05, 0.0, lives=[life, [(0, 2), (1, 1), (0, 7)]], overheads=ov, s_steps=8_000)
    assert full.l_batch == 4.0 and r.s_batch == 1.0 and 1.0 < full.s_batch < 4.0


def test_legs_read_off_a_trace():
    # a: S, S (sends), 0.5 s to L, two L steps 0.2 s apart (1.5 s on L), 0.5 s back, S; b: four S
    # steps, a 0.3 s gap, S
    steps = [Step(0, 0, 1, ["a", "b"], [9, 9]), Step(0, 1, 2, ["a", "b"], [1, 1]), Step(0, 2, 3, ["b"], [1]),
             Step(1, 2.5, 3.2, ["a"], [2]), Step(0, 3, 4.2, ["b"], [1]), Step(1, 3.4, 4, ["a"], [1]),
             Step(0, 4.5, 5, ["a", "b"], [1, 1])]
    legs = request_legs(steps, 0.0, 5.0)
    assert legs == pytest.approx({"on_s": (2.5 + 5.0) / 5, "to_l": 0.1, "on_l": 0.3, "back_to_s": 0.1})
    # a window cuts the legs at its edges; what lies outside it does not count
    legs = request_legs(steps, 1.5, 4.25)
    assert legs == pytest.approx({"on_s": 3.25 / 2.75, "to_l": 0.5 / 2.75, "on_l": 1.5 / 2.75,
                                  "back_to_s": 0.25 / 2.75})
    with pytest.raises(ValueError, match="empty window"):
        request_legs(steps, 2.0, 2.0)


def test_simulator_legs():
    # one request: 3 S steps, 5 ms to L, 2 L steps, a new life at S: the cycle's time in each leg
    r = simulate(1, 1, 0.01, 0.03, 0.0, lives=[[(0, 3), (1, 2)]], handoff=0.005, s_steps=6_000)
    cycle = 3 * 0.01 + 0.005 + 2 * 0.03
    assert r.legs == pytest.approx({"on_s": 0.03 / cycle, "back_to_s": 0.0, "to_l": 0.005 / cycle,
                                    "on_l": 0.06 / cycle}, abs=1e-3)
    # four requests of two lives: every request is in one leg at a time, a step's batch is in it for
    # the whole step, and a send spends at least the hand-off on its way
    ov = Overheads(s_overhead=0.001, l_overhead=0.002, handoff=0.004)
    r = simulate(4, 1, 0.01, 0.03, 0.0, lives=[[(0, 3), (1, 2)], [(0, 5), (1, 1), (0, 2)]], overheads=ov,
                 s_steps=20_000)
    # a life that ends on L is replaced at S, in no leg until S's next step takes it
    assert 3.9 < sum(r.legs.values()) < 3.99
    assert r.legs["on_s"] == pytest.approx(r.s_batch * r.s_steps * 0.011 / r.seconds, rel=1e-3)
    assert r.legs["on_l"] == pytest.approx(r.l_batch * r.l_steps * 0.032 / r.seconds, rel=1e-3)
    sends = r.l_steps * r.l_batch / 1.5 / r.seconds  # spans of 2 and 1 tokens, drawn alike
    assert r.legs["to_l"] > 0.9 * 0.004 * sends and r.legs["back_to_s"] > 0.0
    # with B = 2 a request between two L steps of its span waits for a second request: on L, not in a step
    r = simulate(4, 2, 0.01, 0.03, 0.0, lives=[[(0, 3), (1, 2)], [(0, 5), (1, 1), (0, 2)]], overheads=ov,
                 s_steps=20_000)
    assert r.legs["on_l"] > r.l_batch * r.l_steps * 0.032 / r.seconds + 0.02


def test_simulator_rejects_bad_lives():
    with pytest.raises(ValueError, match="exactly one of p, gaps and lives"):
        simulate(2, 1, 0.01, 0.05, p=0.1, lives=[[(0, 2)]])
    with pytest.raises(ValueError, match=r"lives\[1\]: visits must alternate"):
        simulate(2, 1, 0.01, 0.05, lives=[[(0, 2)], [(1, 1), (0, 2)]])
    with pytest.raises(ValueError, match=r"lives\[0\]"):
        simulate(2, 1, 0.01, 0.05, lives=[[(0, 0)]])
    with pytest.raises(ValueError, match=r"lives\[0\]"):
        simulate(2, 1, 0.01, 0.05, lives=[[(0, 2.5)]])
    with pytest.raises(ValueError, match=r"lives\[0\]"):
        simulate(2, 1, 0.01, 0.05, lives=[[(0, 2, -1)]])
    with pytest.raises(ValueError, match=r"lives\[0\]"):
        simulate(2, 1, 0.01, 0.05, lives=[[(0, 2, 1), (1, 1)]])
    with pytest.raises(ValueError, match="fed for every life"):
        simulate(2, 1, 0.01, 0.05, lives=[[(0, 2, 1)], [(0, 3)]])
    with pytest.raises(ValueError, match="no spans or q_l"):
        simulate(2, 1, 0.01, 0.05, lives=[[(0, 2)]], q_l=0.5)


def test_slo_threshold_trades_throughput_for_the_p99_bound():
    from tokenrouter.planner.slo import slo_threshold

    # co-located, r = 4, N = 8, p = 0.1: throughput peaks near B = 5 while p99 ITL grows with B
    kw = dict(p=0.1, b_values=[1, 3, 5, 7], s_steps=4000)
    free = slo_threshold(8, 0.01, 0.04, 1.0, itl_p99_max=10.0, **kw)
    assert free.feasible and free.b == max(free.points, key=lambda pt: pt.throughput).b and free.b >= 5
    p99 = {pt.b: pt.itl_p99 for pt in free.points}
    assert p99[1] < p99[3] < p99[5] < p99[7]
    bound = (p99[3] + p99[5]) / 2
    tight = slo_threshold(8, 0.01, 0.04, 1.0, itl_p99_max=bound, **kw)
    assert tight.feasible and tight.b == 3 and tight.point().itl_p99 <= bound
    none = slo_threshold(8, 0.01, 0.04, 1.0, itl_p99_max=p99[1] / 2, **kw)
    assert not none.feasible and none.b == 1
    with pytest.raises(ValueError, match="bound"):
        slo_threshold(8, 0.01, 0.04, 1.0, itl_p99_max=0.0, **kw)


def test_controller_window_forgets_a_share_that_changed():
    def feed(ctl, p, tokens):
        rng = np.random.default_rng(0)
        prev = None
        for go in rng.random(tokens) < p:  # a visit of one L token, else an S token
            model = "large" if go and prev != "large" else "small"
            ctl.observe(prev, model)
            prev = model

    kw = dict(lat_s=0.012, lat_l=0.03, alpha=1.0, n_max=4, p0=0.05)
    cumulative = PlannerController("small", "large", window=None, **kw)
    windowed = PlannerController("small", "large", **kw)  # the default memory: 2000 tokens
    try:
        for ctl in (cumulative, windowed):
            feed(ctl, 0.05, 20_000)
            feed(ctl, 0.3, 10_000)
        true_p = 0.3 * 0.7 / (1 - 0.3 * 0.3)  # visits per decision when a visit cannot follow a visit
        assert windowed.estimate[0] == pytest.approx(true_p, rel=0.1)
        assert cumulative.estimate[0] < 0.6 * true_p  # still mostly the old share
        with pytest.raises(ValueError, match="window"):
            PlannerController("small", "large", window=0, **kw)
    finally:
        cumulative.close()
        windowed.close()


def test_controller_measures_the_catch_up_of_runs_that_reached_the_large_model():
    """The catch-up a visit brings is the small model's run before it; runs a request's end cut never
    reach the large model and must not count (a geometric gap of the same p would say more)."""
    ov = Overheads(s_token=0.0005, l_token=0.004)
    ctl = PlannerController("small", "large", lat_s=0.012, lat_l=0.03, alpha=1.0, n_max=8, p0=0.2,
                            min_tokens=1, min_interval=0.0, overheads=ov, window=None)
    try:
        sent_runs = []
        rng = np.random.default_rng(1)
        for _ in range(40):  # requests: runs of 1-4 small tokens, each ended by a large token, then a cut run
            prev, run = None, 0
            for _ in range(int(rng.integers(1, 5))):
                r = int(rng.integers(1, 5))
                for _ in range(r):
                    ctl.observe(prev, "small", run)
                    prev, run = "small", run + 1
                ctl.observe(prev, "large", run)
                sent_runs.append(run)
                prev, run = "large", 0
            for _ in range(30):  # the request's end cuts this run: it never reaches the large model
                ctl.observe(prev, "small", run)
                prev, run = "small", run + 1
        assert ctl.catchup == pytest.approx(np.mean(sent_runs))
        assert ctl.catchup < (1 - ctl.estimate[0]) / ctl.estimate[0]  # below the geometric gap's mean
        deadline = time.monotonic() + 30
        while ctl.catchup_planned is None and time.monotonic() < deadline:
            ctl.poll()
            time.sleep(0.01)
        assert ctl.catchup_planned == pytest.approx(np.mean(sent_runs))
        p = ctl.p_planned
        want = best_thresholds(8, p, 0.012, 0.03, 1.0, min_gain=0.01,
                               overheads=dataclasses.replace(ov, catchup=ctl.catchup_planned))
        assert ctl.table == want
    finally:
        ctl.close()


def test_controller_plans_the_continuous_chain_only_up_to_its_cap(monkeypatch):
    """The continuous chain's cost grows about as N^4 (minutes for N up to 64): above
    CONTINUOUS_MAX_N the re-plan keeps the step-aligned chain, so it stays short on any n_max."""
    monkeypatch.setattr(controller, "CONTINUOUS_MAX_N", 3)
    kw = dict(lat_s=lambda b: 0.010 + 0.001 * b, lat_l=lambda b: 0.030 + 0.004 * b)
    ov = Overheads(s_token=0.001, l_token=0.004)
    ctl = PlannerController("small", "large", alpha=1.0, n_max=6, overheads=ov, **kw)
    try:
        table = ctl._solve(0.3, 0.0, 1.0, 0.0)
    finally:
        ctl.close()
    aligned = best_thresholds(6, 0.3, alpha=1.0, q_l=0.0, min_gain=0.01, **kw)
    continuous = best_thresholds(6, 0.3, alpha=1.0, min_gain=0.01, overheads=dataclasses.replace(ov, catchup=1.0), **kw)
    assert aligned != continuous  # the two chains plan differently here, below and above the cap
    assert table == {n: (continuous if n <= 3 else aligned)[n] for n in range(1, 7)}
