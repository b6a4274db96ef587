"""The latency-model executor: profiles, interference, and the real runtime running on it."""

from __future__ import annotations

import threading

import pytest

from tokenrouter import SamplingParams
from tokenrouter.engine.latency_model import InterferenceClock, LatencyProfile, StepLatency
from tokenrouter.engine.step_board import StepBoard, create_board
from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.group_config import GroupConfig


def test_step_latency_forms():
    lin = StepLatency(base=0.01, per_seq=0.001, per_token=0.0001)
    assert lin(4, 4) == pytest.approx(0.014)
    assert lin(2, 102) == pytest.approx(0.012 + 0.01)  # 100 prefill tokens beyond one per request
    tab = StepLatency.from_dict({"table": [[1, 0.01], [8, 0.02], [16, 0.04]]})
    assert tab(1, 1) == pytest.approx(0.01)
    assert tab(4, 4) == pytest.approx(0.01 + 3 / 7 * 0.01)
    assert tab(32, 32) == pytest.approx(0.08)  # extrapolates the last segment
    assert StepLatency.from_dict(tab.to_dict()) == tab


def test_profile_validation():
    with pytest.raises(ValueError, match="at least one model"):
        LatencyProfile.from_dict({"models": {}})
    with pytest.raises(ValueError, match="interference"):
        LatencyProfile.from_dict({"models": {"a": {"base": 0.1}}, "interference": {"a": {"b": 2.0}}})
    with pytest.raises(ValueError, match="no step latency for model"):
        GroupConfig.from_dict({"models": [{"name": "s", "path": "x"}, {"name": "l", "path": "y"}],
                               "executor": {"mode": "latency", "profile": {"models": {"s": {"base": 0.01}}}}})


def test_interference_stops_progress_while_a_peer_runs():
    shm = create_board()
    try:
        board, peer = StepBoard(shm.name, 0), StepBoard(shm.name, 1)
        clock = InterferenceClock(0, {1: 1.0}, board)
        peer.flags[1] = 1.0  # the peer is in the middle of a step
        t = threading.Thread(target=clock.work, args=(0.005,))
        t.start()
        t.join(0.3)
        assert t.is_alive(), "made progress while a fully interfering peer was running"
        peer.flags[1] = 0.0
        t.join(5.0)
        assert not t.is_alive()
        assert board.flags[0] == 0.0  # its own flag is cleared after the step
        board.close()
        peer.close()
    finally:
        shm.close()
        shm.unlink()


def group(path, p: float = 0.3, **extra) -> dict:
    return {
        "models": [{"name": "small", "path": str(path), "kv_cache_tokens": 8192, "page_size": 4},
                   {"name": "large", "path": str(path), "kv_cache_tokens": 8192, "page_size": 4}],
        "algorithm": {"name": "bernoulli", "p": p},
        "executor": {"mode": "latency", "profile": {"models": {"small": {"base": 0.001}, "large": {"base": 0.003}},
                                                    "interference": {"small": {"large": 1.0}}}},
        **extra,
    }


def test_runtime_on_the_latency_executor(model_paths):
    params = SamplingParams(max_tokens=30, seed=7)
    prompts = [[1, 2, 3, i] for i in range(12)]
    runs = []
    for launch in ({"policy": "eager"}, {"policy": "threshold", "thresholds": {"large": {4: 3, 12: 5}}}):
        with RoutedLLM(group(model_paths["llama"], launch=launch)) as llm:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False, timeout=120)
            stats = llm.entry.stats()
        runs.append([(o.outputs[0].token_ids, o.outputs[0].token_models) for o in outs])
        assert all(len(ids) == 30 for ids, _ in runs[-1])  # tokens never hit EOS
        assert all(s.live_requests == 0 and s.free_pages + s.cached_pages == s.total_pages for s in stats.values())
        large = sum(models.count("large") for _, models in runs[-1])
        assert 0 < large < 12 * 30
    # Tokens and writers are functions of (seed, position): launch timing changes neither.
    assert runs[0] == runs[1]


def test_latency_executor_refuses_algorithms_that_need_model_outputs(model_paths, tmp_path):
    cfg = group(model_paths["llama"])
    cfg["algorithm"] = {"name": "r_stitch", "tau": 0.5}
    with pytest.raises(Exception, match="latency-model executor computes no hidden states"):
        RoutedLLM(cfg)


def test_planner_policy_sets_the_large_models_thresholds(model_paths):
    cfg = group(model_paths["llama"], p=0.2,
                launch={"policy": "planner", "alpha": 1.0, "p": 0.2, "n_max": 12})
    with RoutedLLM(cfg) as llm:
        planner = llm.entry.planner
        assert planner is not None and planner.table[12] > 1  # co-located: the large model waits
        assert planner.look_ahead  # bernoulli defers to the large model, which runs ahead
        outs = llm.generate(prompt_token_ids=[[1, 2, 3, i] for i in range(12)],
                            sampling_params=SamplingParams(max_tokens=40, seed=3), use_tqdm=False, timeout=120)
        assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
        p, q = planner.estimate
        # Every large-model token is a visit (one right after another: a request that came straight
        # back), so p is the large model's share of the tokens, and no span is planned.
        models = [m for o in outs for m in o.outputs[0].token_models]
        assert p == pytest.approx(models.count("large") / len(models)) and q == 0.0
        # The catch-up per queued visit: the small model's tokens since the large model's last one,
        # over the visits a look-ahead row did not answer (read off the outputs' writers).
        runs, returns = [], 0
        for o in outs:
            prev, run = None, 0
            for model in o.outputs[0].token_models:
                if model == "large":
                    runs.append(run)
                    returns += prev == "large"
                run = 0 if model == "large" else run + 1
                prev = model
        assert returns > 0 and planner.returns == returns
        queued = len(runs) - planner.answered_returns
        assert len(runs) >= planner.min_visits and planner.catchup == pytest.approx(sum(runs) / queued)
    with pytest.raises(ValueError, match="two models"):
        GroupConfig.from_dict({**cfg, "models": cfg["models"] + [{"name": "third", "path": "x"}]})


def test_planner_counts_the_returns_look_ahead_answered(model_paths):
    """The planner planning B(1) only (so B = 1 at every load: the large model launches as soon as
    one request is queued, and the rows of the requests it just handed back ride on those steps),
    half the positions deferred: immediate returns are answered, and they reach the planner as
    answered (the subserver's Tokens say so), exactly as many as the large model's hits. (With the
    planner's B above 1 a return usually arrives before the large model launches: its row never rode.)
    Each request has its own seed, so its own routes: with one seed all twelve hand off at the same
    positions, and the large model often has no other work to launch while they are away (no hits)."""
    cfg = group(model_paths["llama"], p=0.5, launch={"policy": "planner", "p": 0.5, "n_max": 1})
    with RoutedLLM(cfg) as llm:
        planner = llm.entry.planner
        llm.generate(prompt_token_ids=[[1, 2, 3, i] for i in range(12)],
                     sampling_params=[SamplingParams(max_tokens=40, seed=3 + i) for i in range(12)],
                     use_tqdm=False, timeout=120)
        hits = llm.entry.stats()["large"].look_ahead_hits
        assert hits > 0 and planner.answered_returns == hits
        assert planner.answered_share == pytest.approx(hits / planner.visits)


def test_planner_measures_latencies_at_start_up(pair_paths):
    cfg = {"models": [{"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 4096},
                      {"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 4096}],
           "algorithm": {"name": "bernoulli", "p": 0.1}, "launch": {"policy": "planner", "n_max": 8}}
    with RoutedLLM(cfg) as llm:
        assert all(r.latency is not None and r.latency["table"] for r in llm.entry.info.values())
        assert set(llm.entry.planner.table) == set(range(1, 9))
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=5, ignore_eos=True),
                           use_tqdm=False, timeout=60)
        assert len(out[0].outputs[0].token_ids) == 5


def test_closed_loop_steady_window_and_step_trace(model_paths, tmp_path, monkeypatch):
    """The closed loop's steady window lies inside the run, while every request slot is taken, and
    the traced steps carry each step's batch (the subservers inherit the trace variable)."""
    from tokenrouter.bench.offline import run_closed_loop
    from tokenrouter.bench.trace_reader import read_trace, runtime_costs
    from tokenrouter.engine.step_trace import ENV
    from tokenrouter.runtime.entry.entry import Entry

    monkeypatch.setenv(ENV, str(tmp_path))
    entry = Entry(GroupConfig.from_dict(group(model_paths["llama"], p=0.2)))
    try:
        # half the requests route with their own p = 0 (the small model writes every token)
        res = run_closed_loop(entry, [[1, 2, 3, i] for i in range(6)], SamplingParams(max_tokens=20, ignore_eos=True),
                              concurrency=3, warmup_tokens=4, routings=[None, {"p": 0.0}] * 3)
        with pytest.raises(ValueError, match="one per prompt"):
            run_closed_loop(entry, [[1, 2, 3]], SamplingParams(max_tokens=2), concurrency=1, routings=[])
    finally:
        entry.close()
    assert res.output_tokens == 120
    # one time to first token per request, one inter-token gap per later token
    assert len(res.ttft) == 6 and len(res.itl) == 120 - 6 and min(res.ttft + res.itl) >= 0
    steps = read_trace(str(tmp_path))
    seen_by_large = {r for s in steps if s.model == 1 for r in s.rids}
    assert 1 <= len(seen_by_large) <= 3  # only the three without p = 0
    start, end = res.steady_window
    assert 0 < end - start < res.wall_seconds and 0 < res.steady_tokens < 120
    assert {s.model for s in steps} == {0, 1} and all(len(s.rids) == len(s.extend_lens) for s in steps)
    assert runtime_costs(steps).s_steps == sum(s.model == 0 for s in steps)
