"""A user's routing algorithm that raises on one request's parameters fails that request alone: in a
batch of six through a routed pair, whichever call of the algorithm raises (route, send, receive,
on_start, on_finish), the five others finish whole and token-exact, with both models writing, and the
failure is counted at the model."""

from __future__ import annotations

import time

import pytest
from engine_utils import prompts_of
from routing_utils import Rig, group_dict, write_picky

from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.messages import AddReq, ReqError
from tokenrouter.sampling_params import SamplingParams

N = 12
BAD = 2  # the request whose routing parameters the algorithm fails on
PROMPTS = prompts_of([5, 6, 7, 8, 9, 10], seed=28)
PARAMS = [SamplingParams(max_tokens=N, temperature=0.0, seed=100 + i, ignore_eos=True) for i in range(6)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory, pair_paths):
    folder = tmp_path_factory.mktemp("picky")
    cfg = group_dict(pair_paths, 0.5)
    cfg["algorithm"] = {"name": write_picky(folder), "p": 0.5}
    with RoutedLLM(cfg) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    """The five good requests alone (no bad request in any batch)."""
    good = [i for i in range(6) if i != BAD]
    outs = llm.generate(prompt_token_ids=[PROMPTS[i] for i in good], sampling_params=[PARAMS[i] for i in good],
                        use_tqdm=False, timeout=120)
    return {i: o.outputs[0] for i, o in zip(good, outs)}


def idle(llm: RoutedLLM) -> dict[str, tuple[int, int]]:
    return {n: (s.live_requests, s.total_pages - s.free_pages - s.cached_pages) for n, s in llm.entry.stats().items()}


@pytest.mark.parametrize("stage", ["route", "send", "receive", "on_start", "on_finish"])
def test_one_request_the_algorithm_fails_on_fails_alone(llm, reference, stage):
    before = {n: dict(s.request_errors) for n, s in llm.entry.stats().items()}
    routing = [{"fail_in": stage} if i == BAD else None for i in range(6)]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, routing=routing, use_tqdm=False,
                        timeout=120)
    bad = outs[BAD]
    assert bad.outputs[0].finish_reason == "error", bad.outputs[0]
    error = bad.extra["error"]
    assert "routing algorithm 'picky' failed on this request" in error and f"in {stage} " in error, error
    assert "Traceback" not in error
    writers = set()
    for i, out in enumerate(outs):
        if i == BAD:
            continue
        got, want = out.outputs[0], reference[i]
        assert got.finish_reason == "length" and len(got.token_ids) == N, (i, got)
        assert got.token_ids == want.token_ids, f"request {i} is not token-exact"
        assert got.token_models == want.token_models, f"request {i} was routed differently"
        writers.update(got.token_models)
    assert writers == {"small", "large"}, writers
    after = {n: s.request_errors for n, s in llm.entry.stats().items()}
    counted = sum(after[n].get(stage, 0) - before[n].get(stage, 0) for n in after)
    assert counted >= 1, (before, after)
    deadline = time.monotonic() + 10  # a peer's abort may still be on its way
    while idle(llm) != {"small": (0, 0), "large": (0, 0)}:
        assert time.monotonic() < deadline, f"(live requests, pages in use) left: {idle(llm)}"
        time.sleep(0.1)
    assert all(p.is_alive() for p in llm.entry.procs.values())


@pytest.mark.parametrize("stage", ["route", "send", "receive", "on_start", "on_finish"])
def test_a_request_failed_here_is_forgotten_by_the_algorithm(pair_paths, tmp_path, stage):
    """In-process subservers: a request the algorithm fails on ends through the same funnel as any
    other, so its on_finish runs (at most once) and no model keeps its parameters or its record."""
    rig = Rig(pair_paths, 0.5, algorithm={"name": write_picky(tmp_path), "p": 0.5})
    try:
        params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
        rig.send("small", AddReq("bad", PROMPTS[0], params, 3, {"p": 0.5, "fail_in": stage}))
        rig.pump(lambda: any(isinstance(m, ReqError) and m.rid == "bad" for m in rig.msgs), "the failure")
        rig.abort("bad")  # as the entry does on a ReqError
        rig.settle()
        for name in ("small", "large"):
            rig.assert_clean(name)
            assert rig.subs[name].algorithm.params_of == {}, (name, rig.subs[name].algorithm.params_of)
    finally:
        rig.close()
