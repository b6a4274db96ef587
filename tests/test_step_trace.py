"""The latency executor's step trace, and the runtime's costs read off it (tokenrouter/engine/step_trace.py
writes it, tokenrouter/bench/trace_reader.py reads it)."""

from __future__ import annotations

import json

import pytest

from tokenrouter.bench.trace_reader import Step, read_stages, read_trace, runtime_costs
from tokenrouter.engine.step_trace import ENV, StepTraceWriter


def test_trace_writer_and_reader(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    w = StepTraceWriter.from_env()
    w.write(0, 1.0, 1.5, ["a"], [1])
    w.write(1, 2.0, 2.5, ["a", "b"], [10, 3])
    assert [s.rids for s in read_trace(str(tmp_path))] == [["a"], ["a", "b"]]
    assert [s.model for s in read_trace(str(tmp_path), start=1.5)] == [1]
    monkeypatch.delenv(ENV)
    StepTraceWriter.from_env().write(0, 0.0, 1.0, [], [])  # tracing off: nothing written
    assert len(list(tmp_path.iterdir())) == 1
    assert json.loads((next(tmp_path.iterdir())).read_text().splitlines()[0])[3] == ["a"]


def test_runtime_costs_from_a_trace():
    steps = [
        Step(0, 0.000, 0.010, ["a", "b"], [1, 1]),  # a hands off after this step
        Step(1, 0.011, 0.031, ["a"], [5]),  # L was idle: hand-off latency 1 ms
        Step(0, 0.012, 0.022, ["b", "c"], [1, 1]),  # S gap 2 ms; b hands off
        Step(0, 0.025, 0.035, ["c"], [1]),  # S gap 3 ms
        Step(1, 0.032, 0.052, ["b"], [1]),  # L busy when b came: queueing, not hand-off latency
        Step(0, 0.100, 0.110, ["c"], [1]),  # an idle period, not overhead
    ]
    costs = runtime_costs(sorted(steps, key=lambda s: s.start))
    assert costs.s_step_gap == pytest.approx(0.0025)
    assert costs.l_step_gap == pytest.approx(0.001)
    assert costs.handoff == pytest.approx(0.001) and costs.handoffs == 1  # b found L busy: queueing


def test_stage_records_pair_with_the_step_before_them(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    w = StepTraceWriter.from_env()
    assert w.enabled
    w.write(0, 1.0, 1.012, ["a", "b"], [1, 1])
    w.write_stages(0, 0.999, {"forward": 0.0125, "route": 0.0001})
    w.write_stages(-1, 1.02, {"reassembly": 0.0003, "tokens": 2})  # the entry's: no step
    assert [s.rids for s in read_trace(str(tmp_path))] == [["a", "b"]]  # stage lines are not steps
    recs = read_stages(str(tmp_path))
    assert [r.model for r in recs] == [0, -1]
    assert recs[0].step is not None and recs[0].step.rids == ["a", "b"] and recs[0].stages["route"] == 0.0001
    assert recs[1].step is None and recs[1].stages["tokens"] == 2
    assert [r.model for r in read_stages(str(tmp_path), start=1.01)] == [-1]
    monkeypatch.delenv(ENV)
    off = StepTraceWriter.from_env()
    assert not off.enabled
    off.write_stages(0, 0.0, {"route": 1.0})  # tracing off: nothing written
    assert len(read_stages(str(tmp_path))) == 2


def test_real_model_steps_are_traced_like_the_latency_executors(tmp_path, monkeypatch, model_paths):
    """An engine that knows its index in a group traces each step of a real model (requests, extend
    lengths), so run lengths between sends are read off real models too; one without an index does not."""
    from tokenrouter import SamplingParams
    from tokenrouter.bench.trace_reader import send_runs
    from tokenrouter.engine.config import EngineConfig
    from tokenrouter.engine.engine import Engine

    monkeypatch.setenv(ENV, str(tmp_path))
    cfg = EngineConfig(model_path=str(model_paths["llama"]), kv_cache_tokens=512, page_size=4, device="cpu")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for traced in (None, 1):
        eng = Engine(cfg, trace_index=traced)
        a = eng.add_request([1, 2, 3], params, rid=f"a{traced}")
        b = eng.add_request([4, 5], params, rid=f"b{traced}")
        while eng.has_unfinished():
            eng.step()
        assert a.finished and b.finished
    steps = read_trace(str(tmp_path))
    assert {s.model for s in steps} == {1} and {r for s in steps for r in s.rids} == {"a1", "b1"}
    assert steps[0].rids == ["a1", "b1"] and steps[0].extend_lens == [3, 2]  # the prefill step
    assert all(s.extend_lens == [1, 1] for s in steps[1:]) and len(steps) == 4
    assert all(s.start <= s.end for s in steps)
    runs = send_runs(steps, 1)
    assert runs.sent == [] and sorted(runs.cut) == [4, 4]  # one visit each, cut by the request's end
