"""The delayed-batching throughput model (tokenrouter.planner, docs/DESIGN.md section 5)."""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest

from tokenrouter.planner import (
    Constant,
    Linear,
    Table,
    as_latency,
    best_thresholds,
    full_chain,
    gaps_to_p,
    parse_latency,
    plan,
    solve,
    stationary_distribution,
    throughput,
    throughput_curve,
    zero_wait_bound,
)
from tokenrouter.planner.cli import add_plan_parser, main, parse_n
from tokenrouter.planner.sim import simulate

# -- the figures docs/DESIGN.md section 5 states: N = 8, p = 0.1, r = 4 ------------------------------------------


def test_design_separate_devices_eager_is_near_optimal():
    curve = throughput_curve(8, 0.1, 1.0, 4.0, alpha=0.0)
    gain = curve.max() / curve[0]
    assert 1.0 <= gain < 1.01  # "the best B gains well under 1% over B = 1"
    assert gain < 1.005


def test_design_serialised_best_b_is_5_and_gains_1_6x():
    curve = throughput_curve(8, 0.1, 1.0, 4.0, alpha=1.0)
    assert int(curve.argmax()) + 1 == 5  # "a best B of 5"
    assert curve.max() / curve[0] == pytest.approx(1.6, abs=0.05)  # "1.6x the throughput of eager launching"
    assert best_thresholds(8, 0.1, 1.0, 4.0, 1.0)[8] == 5


# -- the chain's own invariants --------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("q_l", [0.0, 0.4])
def test_stationary_distribution_is_a_distribution(alpha, q_l):
    for B in (1, 3, 8):
        sol = solve(8, B, 0.1, 1.0, 4.0, alpha, q_l=q_l)
        assert sol.pi.sum() == pytest.approx(1.0, abs=1e-12)
        assert sol.pi.min() >= 0.0
        assert sol.time_share.sum() == pytest.approx(1.0, abs=1e-12)
        fc = full_chain(8, B, 0.1, 4, alpha, q_l=q_l)
        pi = fc.stationary()
        assert pi.sum() == pytest.approx(1.0, abs=1e-12)
        assert pi.min() >= 0.0
        assert np.abs(fc.P.T @ pi - pi).max() < 1e-12  # stationary
        assert np.allclose(np.asarray(fc.P.sum(axis=1)).ravel(), 1.0)  # row-stochastic


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("q_l", [0.0, 0.3])
@pytest.mark.parametrize("B", [1, 2, 5, 8])
def test_embedded_chain_equals_the_full_qbc_chain(alpha, q_l, B):
    """The fast embedded solve and the (q, b, c) chain of docs/DESIGN.md section 5 give the same throughput."""
    fc = full_chain(8, B, 0.15, 4, alpha, q_l=q_l)
    assert fc.throughput_per_step() == pytest.approx(throughput(8, B, 0.15, 1.0, 4.0, alpha, q_l=q_l), rel=1e-9)


def test_full_chain_with_batch_dependent_r():
    r = lambda b: 2 + b // 3  # noqa: E731
    for B in (1, 4):
        fc = full_chain(10, B, 0.2, r, 0.0)
        emb = throughput(10, B, 0.2, 1.0, lambda b: float(r(b)), 0.0)
        assert fc.throughput_per_step() == pytest.approx(emb, rel=1e-9)


LATENCIES = [
    (1.0, 4.0),
    (Constant(0.01), Constant(0.2)),
    (Linear(0.010, 0.0005), Linear(0.040, 0.002)),
    (Table([(1, 0.008), (8, 0.009), (32, 0.014)]), Table([(1, 0.03), (16, 0.036), (64, 0.06)])),
]


@pytest.mark.parametrize("lat", LATENCIES)
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_throughput_never_exceeds_the_zero_wait_bound(lat, alpha):
    lat_s, lat_l = lat
    for n in (1, 2, 5, 12):
        for p in (0.02, 0.1, 0.5, 1.0):
            for q_l in (0.0, 0.5):
                bound = zero_wait_bound(n, p, lat_s, lat_l, q_l=q_l)
                curve = throughput_curve(n, p, lat_s, lat_l, alpha, q_l=q_l)
                assert np.all(curve > 0)
                assert np.all(curve <= bound * (1 + 1e-12)), (n, p, q_l, curve.max(), bound)


def test_zero_wait_bound_formula():
    assert zero_wait_bound(8, 0.1, 1.0, 4.0) == pytest.approx(8 / 1.4)
    assert zero_wait_bound(8, 0.1, 0.02, 0.08) == pytest.approx(8 / (0.02 + 0.1 * 0.08))
    # spans: per cycle 1 - p + p/(1-q) tokens in t_S + p t_L/(1-q) seconds
    assert zero_wait_bound(4, 0.2, 1.0, 3.0, q_l=0.5) == pytest.approx(4 * (0.8 + 0.4) / (1 + 0.2 * 3 * 2))


def test_one_request_is_b_equals_1():
    assert best_thresholds(1, 0.1, 1.0, 4.0, 0.0) == {1: 1}
    assert best_thresholds(1, 0.3, 1.0, 4.0, 1.0) == {1: 1}
    # one request is its own chain of steps: the zero-wait bound is exact
    for alpha in (0.0, 0.5, 1.0):
        assert throughput(1, 1, 0.1, 1.0, 4.0, alpha) == pytest.approx(zero_wait_bound(1, 0.1, 1.0, 4.0), rel=1e-9)


@pytest.mark.parametrize("lat_s", [0.02, Linear(0.01, 0.001)])
def test_no_routing_gives_n_over_t_s(lat_s):
    s = as_latency(lat_s)
    for n in (1, 4, 16):
        curve = throughput_curve(n, 0.0, lat_s, 0.5, alpha=1.0)
        assert np.allclose(curve, n / s(n), rtol=1e-12)
    assert best_thresholds(6, 0.0, lat_s, 0.5, 0.0) == {n: 1 for n in range(1, 7)}


def test_everything_routed_still_solves():
    curve = throughput_curve(6, 1.0, 1.0, 4.0, alpha=0.0)
    # every S step hands every request over; the L batch is always all N requests
    assert curve[-1] == pytest.approx(6 / (1 + 4))


def test_min_gain_prefers_eager_launching_when_waiting_barely_pays():
    assert best_thresholds(8, 0.1, 1.0, 4.0, 0.0)[8] == 2
    assert best_thresholds(8, 0.1, 1.0, 4.0, 0.0, min_gain=0.01)[8] == 1
    assert best_thresholds(8, 0.1, 1.0, 4.0, 1.0, min_gain=0.01)[8] == 4  # B=4 is within 0.03% of B=5


def test_best_thresholds_table_shape():
    table = best_thresholds(12, 0.1, Linear(0.010, 0.0005), Linear(0.040, 0.002), 1.0)
    assert sorted(table) == list(range(1, 13))
    assert all(1 <= b <= n for n, b in table.items())


def test_large_solve_runs():
    """N = 64, r = 20: every B through the embedded chain, and the sparse chain of docs/DESIGN.md section 5 at B = 1."""
    curve = throughput_curve(64, 0.1, 1.0, 20.0, alpha=0.0)
    assert len(curve) == 64 and np.all(curve <= zero_wait_bound(64, 0.1, 1.0, 20.0))
    fc = full_chain(64, 1, 0.1, 20, 0.0)
    assert fc.P.shape[0] > 40000
    assert fc.throughput_per_step() == pytest.approx(curve[0], rel=1e-8)


def test_plan_rows():
    rows = plan([4, 8], 0.1, 1.0, 4.0, 1.0)
    assert [r.n for r in rows] == [4, 8]
    assert rows[1].best_b == 5 and len(rows[1].throughput) == 8
    assert rows[1].gain_over_b1 == pytest.approx(rows[1].best_throughput / rows[1].throughput[0])


def test_stationary_distribution_of_small_chains():
    P = np.array([[0.5, 0.5, 0.0], [0.25, 0.5, 0.25], [0.0, 0.5, 0.5]])
    assert np.allclose(stationary_distribution(P), [0.25, 0.5, 0.25])
    # state 2 is not reachable from 0: it gets 0
    P2 = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.0, 0.5]])
    assert np.allclose(stationary_distribution(P2), [0.5, 0.5, 0.0])


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="alpha"):
        throughput(4, 1, 0.1, 1.0, 4.0, alpha=1.5)
    with pytest.raises(ValueError, match="threshold B"):
        throughput(4, 5, 0.1, 1.0, 4.0)
    with pytest.raises(ValueError, match="p must"):
        throughput(4, 1, -0.1, 1.0, 4.0)
    with pytest.raises(ValueError, match="integer r"):
        full_chain(4, 1, 0.1, 2.5)


# -- latency models, gaps ---------------------------------------------------------------------------


def test_latency_specs():
    assert parse_latency("0.02")(7) == pytest.approx(0.02)
    assert parse_latency("0.01,0.001")(10) == pytest.approx(0.02)
    t = parse_latency("1:0.010,8:0.012,32:0.020")
    assert t(1) == pytest.approx(0.010) and t(0.5) == pytest.approx(0.010)
    assert t(4.5) == pytest.approx(0.011)
    assert t(64) == pytest.approx(0.020 + 32 * 0.008 / 24)  # last segment extended
    assert isinstance(as_latency((0.01, 0.001)), Linear)
    assert isinstance(as_latency([(1, 0.01), (2, 0.02), (4, 0.03)]), Table)
    with pytest.raises(ValueError):
        parse_latency("fast")


def test_latency_from_json_file(tmp_path):
    f = tmp_path / "lat.json"
    f.write_text(json.dumps({"points": [[1, 0.01], [16, 0.02]]}))
    assert parse_latency(f"@{f}")(16) == pytest.approx(0.02)


def test_gaps_to_p():
    assert gaps_to_p({9: 1}) == pytest.approx(0.1)
    assert gaps_to_p({0: 1, 18: 1}) == pytest.approx(0.1)
    assert gaps_to_p([(4, 3), (0, 0)]) == pytest.approx(0.2)


# -- the simulator agrees with the chain where the chain is exact -----------------------------------


@pytest.mark.parametrize("alpha,B", [(0.0, 1), (0.0, 5)])
def test_simulator_matches_chain(alpha, B):
    # Separate devices, whole-step L: L launches and returns on S's boundaries, where the aligned
    # chain is exact for the continuous-time simulator (co-located: tests/test_planner_continuous.py)
    sim = simulate(8, B, 1.0, 4.0, alpha, p=0.1, q_l=0.2, s_steps=20000, seed=3)
    exact = throughput(8, B, 0.1, 1.0, 4.0, alpha, q_l=0.2)
    assert abs(sim.throughput - exact) < max(5 * sim.stderr, 0.02 * exact)


def test_simulator_runs_a_gap_histogram():
    sim = simulate(4, 2, 1.0, 4.0, 1.0, gaps={0: 1, 18: 1}, s_steps=5000, seed=1)
    assert 0 < sim.throughput <= zero_wait_bound(4, 0.1, 1.0, 4.0) * 1.05


# -- command line --------------------------------------------------------------------------------------


def test_parse_n():
    assert parse_n("8") == [8]
    assert parse_n("1-4,8,16") == [1, 2, 3, 4, 8, 16]
    with pytest.raises(ValueError):
        parse_n("0-3")


def test_cli_json(capsys):
    assert main(["--n", "4,8", "--p", "0.1", "--r", "4", "--alpha", "0,1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best_b"]["p=0.1,alpha=1"]["8"] == 5
    row = [r for r in out["rows"] if r["n"] == 8 and r["alpha"] == 1][0]
    assert len(row["throughput"]) == 8 and row["gain_over_b1"] == pytest.approx(1.637, abs=0.01)
    assert row["zero_wait_bound"] == pytest.approx(8 / 1.4)


def test_cli_text_table_and_full_method(capsys):
    assert main(["--n", "6", "--p", "0.2", "--r", "3", "--alpha", "1", "--method", "full"]) == 0
    out = capsys.readouterr().out
    assert "best B per N" in out and "full chain" in out and "<- best" in out


def test_cli_latency_and_gaps(capsys):
    assert main(["--n", "4", "--gaps", "0:1,18:1", "--lat-s", "0.01,0.0005", "--lat-l", "1:0.04,8:0.05",
                 "--simulate", "--sim-steps", "2000", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "p = 0.1" in out and "sim best B" in out


def test_cli_errors(capsys):
    assert main(["--n", "4", "--p", "0.1"]) == 2
    assert "give --r" in capsys.readouterr().err
    assert main(["--n", "4", "--p", "0.1", "--r", "4", "--lat-s", "0.01"]) == 2
    assert main(["--n", "4", "--r", "4"]) == 2


def test_add_plan_parser_wires_into_a_main_parser(capsys):
    parser = argparse.ArgumentParser(prog="tokenrouter")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    args = parser.parse_args(["plan", "--n", "8", "--p", "0.1", "--r", "4", "--alpha", "1", "--summary"])
    assert args.func(args) == 0
    assert re.search(r"^\s+8\s+5\s", capsys.readouterr().out, re.M)
