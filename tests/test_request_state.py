"""A subserver's request records without processes: check_integrity catches a record that disagrees
with the engine's requests or with itself, and a record's trace follows the hand-off path."""

from __future__ import annotations

import pytest

from tokenrouter.engine.req import Req, ReqStatus
from tokenrouter.routing.algorithm import Route, Scores
from tokenrouter.runtime.messages import Trace
from tokenrouter.runtime.subserver.request_state import RequestState, RequestStates
from tokenrouter.sampling_params import SamplingParams


def engine_req(rid: str) -> Req:
    return Req(rid=rid, tokens=[1, 2, 3], prompt_len=3, params=SamplingParams(), seed=0)


def two_live() -> tuple[RequestStates, dict[str, Req]]:
    reqs = {"a": engine_req("a"), "b": engine_req("b")}
    states = RequestStates()
    states.start(RequestState(reqs["a"], traced=True))
    states.start(RequestState(reqs["b"], alone=True))
    states.check_integrity(reqs)
    return states, reqs


def test_a_record_without_an_engine_request_and_the_converse_are_caught():
    states, reqs = two_live()
    del reqs["b"]
    with pytest.raises(AssertionError, match="records"):
        states.check_integrity(reqs)
    states, reqs = two_live()
    reqs["c"] = engine_req("c")
    with pytest.raises(AssertionError, match="records"):
        states.check_integrity(reqs)
    states, reqs = two_live()
    reqs["b"] = engine_req("b")  # the rid started again in the engine, the record left from before
    with pytest.raises(AssertionError, match="the record of another request"):
        states.check_integrity(reqs)


def test_a_trace_on_an_untraced_request_is_caught():
    states, reqs = two_live()
    states.live["a"].received(Trace(["large", "small"], 0.7, 0.5))
    states.check_integrity(reqs)  # traced: it may hold what its hand-off carried
    states.live["b"].received(Trace(["large", "small"]))
    assert states.live["b"].incoming is None  # an untraced request keeps no trace
    states.live["b"].incoming = Trace(["large", "small"])
    with pytest.raises(AssertionError, match="a trace on an untraced request"):
        states.check_integrity(reqs)


def test_a_flag_count_that_drifts_or_a_wrong_at_peer_is_caught():
    states, reqs = two_live()
    states.live["b"].traced = True
    with pytest.raises(AssertionError, match="traced count drifted"):
        states.check_integrity(reqs)
    states, reqs = two_live()
    reqs["a"].status = ReqStatus.PENDING
    with pytest.raises(AssertionError, match="at a peer"):
        states.check_integrity(reqs)


def test_ending_a_record_frees_its_trace_and_its_counts():
    states, reqs = two_live()
    states.live["a"].received(Trace(["large", "small"]))
    ended = states.end("a")
    assert ended is not None and ended.traced and states.traced == 0 and states.alone == 1
    assert states.end("a") is None  # ended twice: nothing left to free
    del reqs["a"]
    states.check_integrity(reqs)


def test_a_trace_names_the_path_and_the_score_that_handed_the_position():
    scores = Scores([0.9, 0.2], [0.5, 0.5])
    state = RequestState(engine_req("a"), traced=True)
    assert state.token_trace(scores, 1) == Trace([], 0.2, 0.5)  # no hand-off before it: this model's score
    # Handed away without its token: the hand-off carries this model's score, the peer's token shows it.
    sent = state.handoff_trace("small", Route("large", keep=False), scores, 0)
    assert sent == Trace(["small", "large"], 0.9, 0.5)
    peer = RequestState(engine_req("a"), traced=True)
    peer.received(sent)
    assert peer.token_trace(None, 0) == Trace(["small", "large"], 0.9, 0.5) and peer.incoming is None
    # Its token kept: the path starts at the writer, and the score went out with that token.
    assert state.handoff_trace("small", Route("large", keep=True), scores, 0) == Trace(["small", "large"])
    alone = RequestState(engine_req("a"), traced=True, alone=True)  # written alone: never routed, so no score
    assert alone.token_trace(scores, 0) == Trace([])
    untraced = RequestState(engine_req("a"))
    assert untraced.token_trace(scores, 0) is None
    assert untraced.handoff_trace("small", Route("large", keep=False), scores, 0) is None
