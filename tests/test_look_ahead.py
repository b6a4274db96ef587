"""Look-ahead: a model that hands a request back with its own token runs that token in its next step and
sets the next sample aside, so the request's immediate return is answered without a step
(engine.py Engine.hand_off / receive, scheduler.py, runtime/subserver/subserver.py).

The promises: the row rides on a step launched for other work and never launches one; a return with
the tokens unchanged gets exactly the token the ordinary path would sample; any other return
discards the sample and keeps the row's KV; a look-ahead row never costs another request its pages,
now or at its next step; a failed step with a look-ahead row in it fails only the requests that fail
alone; an abort frees everything; a routed group writes the same tokens, by the same models, with it
as without it, on every sampling path; the metrics and the trace read the same as without it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch
from engine_utils import make_engine, prompts_of
from routing_utils import Rig, build_pair, find_seed, peer_msgs, wait_until

from tokenrouter.bench.trace_reader import Step, read_trace, visit_runs
from tokenrouter.engine import scheduler
from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine, EngineStats, StepFailed
from tokenrouter.engine.req import Req, ReqStatus
from tokenrouter.engine.step_trace import ENV
from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.runtime.entry.admission import AdmittedPlan
from tokenrouter.runtime.entry.reassembly import Reassembly
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.runtime.messages import Abort, Tokens
from tokenrouter.runtime.subserver import subserver
from tokenrouter.sampling_params import SamplingParams, StructuredOutput


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("look-ahead-models"))


def _commit(engine: Engine, out) -> None:  # type: ignore[no-untyped-def]
    now = time.monotonic()
    for i, (req, tok) in enumerate(zip(out.reqs, out.token_ids)):
        engine.append_token(req, tok, now, out, i)


def _two(engine: Engine, temperature: float = 0.0) -> tuple[Req, Req]:
    """Requests a and b after two steps: a's last token sampled (as a model writes before handing off)."""
    params = SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True)
    a, b = (engine.add_request(p, params) for p in prompts_of([9, 6], seed=31))
    for _ in range(2):
        _commit(engine, engine.forward_step())
    assert a.extend_len == 1 and b.extend_len == 1
    return a, b


def _reference_next(path, a_tokens: list[int], a_prompt_len: int) -> tuple[int, torch.Tensor]:
    """The token and logits the ordinary path samples for a request with these tokens."""
    eng = make_engine(path)
    req = eng.add_request(a_tokens[:a_prompt_len], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    eng.receive(req.rid, a_prompt_len, a_tokens[a_prompt_len:])
    out = eng.forward_step()
    assert out is not None and out.reqs == [req] and out.logits is not None
    return out.token_ids[0], out.logits[0]


def test_the_row_rides_along_and_answers_an_unchanged_return(pair):
    eng = make_engine(pair["large"])
    a, b = _two(eng)
    eng.hand_off(a, look_ahead=True)
    assert a.look_ahead and a.at_peer and a.status is ReqStatus.RUNNING
    eng.hand_off(b)
    assert b.status is ReqStatus.PENDING and not b.look_ahead
    assert not eng.scheduler.has_work() and eng.forward_step() is None, "a look-ahead row launched a step alone"
    assert a.kv_len == len(a.tokens) - 1

    assert eng.receive(b.rid, len(b.tokens), []) is None  # b back: it runs, and a's row rides along
    out = eng.forward_step()
    assert out is not None and out.reqs == [b], "the look-ahead row was not set aside"
    assert a.status is ReqStatus.PENDING and not a.look_ahead and a.kv_len == len(a.tokens)
    assert eng.stats.look_aheads == 1 and eng.stats.sampled_tokens == 5  # 2 x 2, then b
    _commit(eng, out)

    n = len(a.tokens)
    row = eng.receive(a.rid, n, [])
    assert row is not None and row.reqs == [a] and eng.stats.look_ahead_hits == 1
    assert eng.stats.sampled_tokens == 6  # the answered sample is handed out: counted
    assert a.status is ReqStatus.RUNNING and len(a.tokens) == n and a.kv_len == n  # nothing to run
    token, logits = _reference_next(pair["large"], a.tokens, a.prompt_len)
    assert row.token_ids == [token]
    assert row.logits is not None and torch.allclose(row.logits[0], logits, atol=1e-5)
    _commit(eng, row)
    assert a.tokens[-1] == token and a.extend_len == 1
    eng.check_integrity()


@pytest.mark.parametrize("change", ["suffix", "rewrite", "cut"])
def test_a_changed_return_discards_the_sample(pair, change):
    eng = make_engine(pair["large"])
    a, b = _two(eng)
    eng.hand_off(a, look_ahead=True)
    _commit(eng, eng.forward_step())  # b decodes; a's row runs and is set aside
    n = len(a.tokens)
    assert a.status is ReqStatus.PENDING and a.kv_len == n and a.rid in eng.ahead
    if change == "suffix":  # the peer wrote two more tokens: the look-ahead's KV stays, they run
        assert eng.receive(a.rid, n, [5, 6]) is None
        assert a.kv_len == n and a.extend_len == 2
    elif change == "rewrite":  # the peer rewrote the model's own last token: cut back, it runs again
        assert eng.receive(a.rid, n - 1, [7]) is None
        assert a.kv_len == n - 1 and a.tokens[-1] == 7 and a.extend_len == 1
    else:  # cut with nothing written (an empty suffix, yet not unchanged): the last kept token runs again
        kept = a.tokens[:n - 1]
        assert eng.receive(a.rid, n - 1, []) is None
        assert a.tokens == kept and a.kv_len == n - 2 and a.extend_len == 1
    assert a.rid not in eng.ahead and eng.stats.look_ahead_hits == 0
    out = eng.forward_step()
    assert out is not None and a in out.reqs
    token, _ = _reference_next(pair["large"], a.tokens, a.prompt_len)
    assert out.token_ids[out.reqs.index(a)] == token
    eng.check_integrity()


def test_a_return_before_the_row_ran_runs_it_as_usual(pair):
    eng = make_engine(pair["large"])
    a, _ = _two(eng)
    eng.hand_off(a, look_ahead=True)
    assert eng.receive(a.rid, len(a.tokens), []) is None
    assert not a.look_ahead and not a.at_peer and a.status is ReqStatus.RUNNING and a.extend_len == 1
    out = eng.forward_step()
    assert out is not None and a in out.reqs and eng.stats.look_aheads == 0


def test_no_look_ahead_for_a_request_with_nothing_to_run(pair):
    """A request handed away without a token of this model's (the small model drops its own) has
    nothing this model has not computed: it goes PENDING."""
    eng = make_engine(pair["large"])
    a, _ = _two(eng)
    eng.scheduler.truncate(a, len(a.tokens) - 1)  # as a dropped token: every token has KV
    eng.hand_off(a, look_ahead=True)
    assert a.status is ReqStatus.PENDING and not a.look_ahead


def test_a_look_ahead_row_never_preempts(pair):
    """With the pool full, a look-ahead row that needs a page gives up (PENDING) instead of preempting
    (which would send its request back to the queue to recompute everything)."""
    eng = make_engine(pair["large"], kv_cache_tokens=32, enable_prefix_cache=False)  # 8 pages of 4
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = eng.add_request(prompts_of([8], seed=41)[0], params)  # its row at 8 needs a third page
    b = eng.add_request(prompts_of([16], seed=42)[0], params)
    _commit(eng, eng.forward_step())
    assert a.kv_len == 8 and len(a.pages) == 2 and b.kv_len == 16 and len(b.pages) == 4
    assert eng.pool.num_free == 2
    eng.hand_off(a, look_ahead=True)
    b.tokens.extend([3] * 7)  # b's 8 new tokens take the two free pages
    out = eng.forward_step()
    assert out is not None and out.reqs == [b] and b.kv_len == 24
    assert eng.scheduler.num_preemptions == 0
    assert a.status is ReqStatus.PENDING and not a.look_ahead and a.rid not in eng.ahead and a.kv_len == 8
    eng.check_integrity()
    row = eng.receive(a.rid, len(a.tokens), [])  # back: no sample was set aside, its row runs as usual
    assert row is None and a.status is ReqStatus.RUNNING and a.extend_len == 1


def test_a_blocked_queue_does_not_launch_a_look_ahead_row(pair):
    """The only other work is a queued request the pool cannot admit yet: nothing launches, and the
    look-ahead row waits (it never takes the queue's turn)."""
    eng = make_engine(pair["large"], kv_cache_tokens=32, enable_prefix_cache=False)  # 8 pages of 4
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = eng.add_request(prompts_of([8], seed=43)[0], params)
    _commit(eng, eng.forward_step())
    eng.hand_off(a, look_ahead=True)
    c = eng.add_request(prompts_of([28], seed=44)[0], params)  # 7 pages and a page of headroom: refused
    assert eng.scheduler.has_work()
    assert eng.forward_step() is None
    assert a.look_ahead and a.kv_len == 8 and c.status is ReqStatus.WAITING
    eng.check_integrity()


def _finish(engine: Engine, req: Req) -> list[int]:
    """Step until req finishes; its output."""
    for _ in range(64):
        if req.finished:
            return req.output_ids
        engine.step()
    raise AssertionError(f"{req.rid} did not finish")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_step_failing_as_a_whole_with_a_look_ahead_row_fails_no_one(pair, monkeypatch, temperature):
    """A look-ahead row joins b's step and the step fails as a whole. The row is given up (its request
    lives at the peer), and b, run alone, does not fail: b is not blamed, and finishes whole with the
    tokens it writes without the failure; a runs its row on its next visit."""
    ref = make_engine(pair["large"])
    ra, rb = _two(ref, temperature)
    ref.hand_off(ra, look_ahead=True)
    expected = _finish(ref, rb)

    eng = make_engine(pair["large"])
    a, b = _two(eng, temperature)
    eng.hand_off(a, look_ahead=True)
    run = eng.runner.run

    def fails_in_a_batch(reqs, lens, *rest):  # type: ignore[no-untyped-def]
        if len(reqs) > 1:
            raise RuntimeError("the batch as a whole")
        return run(reqs, lens, *rest)

    monkeypatch.setattr(eng.runner, "run", fails_in_a_batch)
    with pytest.raises(StepFailed) as failed:
        eng.forward_step()
    assert failed.value.failed == [] and b.status is ReqStatus.RUNNING and b.rid in eng.reqs
    assert a.rid in eng.reqs and a.status is ReqStatus.PENDING and not a.look_ahead and a.extend_len == 1
    eng.check_integrity()
    monkeypatch.setattr(eng.runner, "run", run)
    assert _finish(eng, b) == expected and b.finish_reason == "length"
    assert eng.receive(a.rid, len(a.tokens), []) is None
    out = eng.forward_step()
    assert out is not None and out.reqs == [a]
    eng.check_integrity()


@pytest.mark.parametrize("broken", ["bystander", "look-ahead row"])
def test_the_request_whose_own_data_breaks_the_step_is_the_one_failed(pair, broken):
    """A request's sampling parameters break every step it is in (a top_k the sampler's tensor cannot
    hold), in a step of b with a's look-ahead row. The one failed is that request, whichever it is:
    b at once; a (whose row is only given up) at its next visit, where it runs as an ordinary row."""
    eng = make_engine(pair["large"])
    a, b = _two(eng)
    eng.hand_off(a, look_ahead=True)
    bad = b if broken == "bystander" else a
    bad.params = dataclasses.replace(bad.params, temperature=1.0, top_k=2**63)
    with pytest.raises(StepFailed) as failed:
        eng.forward_step()
    assert a.status is ReqStatus.PENDING and not a.look_ahead
    if bad is b:
        assert failed.value.failed == [b] and b.finish_reason == "error"
        assert eng.receive(a.rid, len(a.tokens), []) is None
        out = eng.forward_step()
        assert out is not None and out.reqs == [a]
    else:
        assert failed.value.failed == [] and b.status is ReqStatus.RUNNING
        out = eng.forward_step()
        assert out is not None and out.reqs == [b]
        _commit(eng, out)
        assert eng.receive(a.rid, len(a.tokens), []) is None
        with pytest.raises(StepFailed) as failed:
            eng.forward_step()
        assert failed.value.failed == [a] and a.finish_reason == "error"
        assert b.status is ReqStatus.RUNNING and not b.finished
    eng.check_integrity()


@pytest.mark.parametrize("b_prompt, row_runs", [(19, False), (18, True)])
def test_a_look_ahead_row_takes_no_page_a_running_request_needs_next(pair, b_prompt, row_runs):
    """One page is free and a's row needs it. With b's next token needing it too (b_prompt 19: b's
    token at 19 fills its fifth page, the one at 20 needs a sixth), the row gives up: taking it would
    preempt b at the next step, which without look-ahead does not happen. When b's next token fits
    (18), the row takes the last page. Either way the two steps preempt nothing and b writes the tokens
    it writes without look-ahead."""
    runs = {}
    for look_ahead in (True, False):
        eng = make_engine(pair["large"], kv_cache_tokens=32, enable_prefix_cache=False)  # 8 pages of 4
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        a = eng.add_request(prompts_of([8], seed=45)[0], params)  # its row at 8 needs a third page
        b = eng.add_request(prompts_of([b_prompt], seed=46)[0], params)
        _commit(eng, eng.forward_step())
        assert len(a.pages) == 2 and len(b.pages) == 5 and eng.pool.num_free == 1
        eng.hand_off(a, look_ahead=look_ahead)
        for _ in range(2):
            out = eng.forward_step()
            assert out is not None and out.reqs == [b], "b was preempted"
            _commit(eng, out)
        assert eng.scheduler.num_preemptions == 0 and b.kv_len == b_prompt + 2
        assert a.status is ReqStatus.PENDING and a.kv_len == 8 + (look_ahead and row_runs)
        assert eng.stats.look_aheads == (look_ahead and row_runs)
        eng.check_integrity()
        runs[look_ahead] = list(b.tokens)
    assert runs[True] == runs[False]


def test_check_integrity_holds_look_ahead_to_its_invariants(pair):
    eng = make_engine(pair["large"])
    a, b = _two(eng)
    eng.hand_off(a, look_ahead=True)
    _commit(eng, eng.forward_step())
    eng.check_integrity()  # a PENDING with its row set aside, b decoding
    eng.scheduler.resume(a)  # a set-aside row of a RUNNING request
    with pytest.raises(AssertionError, match="set-aside row"):
        eng.check_integrity()
    eng.scheduler.set_pending(a)
    b.look_ahead = True
    b.tokens.append(7)  # two tokens to run: not a look-ahead row
    with pytest.raises(AssertionError, match="look-ahead while running with 2 tokens"):
        eng.check_integrity()


def test_the_trace_counts_look_ahead_rows_apart(pair, tmp_path, monkeypatch):
    """A look-ahead row is not its request's decision: the step-trace line lists it as a count, so the
    run lengths read off a trace (bench/trace_reader.py visit_runs) see the request at its peer."""
    monkeypatch.setenv(ENV, str(tmp_path))
    eng = Engine(EngineConfig(model_path=str(pair["large"]), kv_cache_tokens=4096, page_size=4, device="cpu"),
                 trace_index=1)
    a, b = _two(eng)
    eng.hand_off(a, look_ahead=True)
    _commit(eng, eng.forward_step())
    *_, last = read_trace(str(tmp_path))
    assert last.rids == [b.rid] and last.extend_lens == [1] and last.ahead_rids == [a.rid] and last.rows == 2
    # a's two steps before the hand-off, and no third
    assert visit_runs(read_trace(str(tmp_path)))[a.rid] == [(1, 2, a.prompt_len - 1)]


def test_abort_frees_a_set_aside_row(pair):
    eng = make_engine(pair["large"])
    a, b = _two(eng)
    eng.hand_off(a, look_ahead=True)
    _commit(eng, eng.forward_step())
    assert a.rid in eng.ahead
    eng.abort(a.rid)
    eng.abort(b.rid)
    assert not eng.ahead and not eng.reqs
    eng.check_integrity()
    assert eng.pool.num_free + eng.cache.total_pages == eng.pool.num_pages and eng.cache.locked_pages == 0


def _group_run(rig: Rig, temperature: float) -> dict[str, list[tuple[str, int, int]]]:
    rids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        rig.add(rid, prompts_of([12 + 3 * i], seed=50 + i)[0], seed=100 + i, max_tokens=24, temperature=temperature)
    rig.pump(lambda: all(rig.finished(r) for r in rids) and not rig.small.engine.reqs and not rig.large.engine.reqs,
             "every request finished everywhere")
    rig.settle()
    for name in ("small", "large"):
        rig.assert_clean(name)
    return {r: sorted(rig.tokens(r), key=lambda t: t[1]) for r in rids}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_routed_group_writes_the_same_tokens_with_it(pair, temperature):
    """Bernoulli routing at p = 0.5 (the small model hands the position right after the large
    model's token back half the time), four requests stepped in turn: every token, its position and
    the model that wrote it are the same with and without look-ahead. (How many returns a look-ahead
    answers here depends on when the in-process sockets deliver; the scenario below makes one.)"""
    with_it, without = Rig(pair, 0.5), Rig(pair, 0.5, launch={"look_ahead": False})
    try:
        assert _group_run(with_it, temperature) == _group_run(without, temperature)
        assert with_it.large.engine.stats.look_aheads > 0
        assert with_it.small.engine.stats.look_aheads == 0  # the deferral algorithms look ahead on the large only
        assert without.large.engine.stats.look_aheads == 0
    finally:
        with_it.close()
        without.close()


def test_a_large_model_on_two_ranks_writes_the_same_tokens_with_it(pair, temperature=0.0):
    """The group above with the large model tensor-parallel over two ranks (its look-ahead rows run on
    both), greedy: the same tokens by the same models with look-ahead as without, and as on one rank.
    (Sampled on two ranks: the answered-return test below.)"""
    tp = {"large": {"tp_size": 2}}
    with_it, without = Rig(pair, 0.5, **tp), Rig(pair, 0.5, launch={"look_ahead": False}, **tp)
    try:
        assert with_it.large.engine.tp is not None
        got = _group_run(with_it, temperature)
        assert got == _group_run(without, temperature)
        assert with_it.large.engine.stats.look_aheads > 0 and without.large.engine.stats.look_aheads == 0
    finally:
        with_it.close()
        without.close()
    one_rank = Rig(pair, 0.5)
    try:
        assert got == _group_run(one_rank, temperature)
    finally:
        one_rank.close()


P = 0.5


def _answered_return(rig: Rig, **a_params: Any) -> tuple[list[int], list[int]]:
    """A's return answered from its look-ahead row, step by step: A goes to the large model, which
    writes its token; B reaches the large model before A's hand-back is handled; A, back on the small
    model, defers the next position at once, and the large model's next step (B's first) runs A's
    row ahead while A's return is on its way. `a_params`: A's sampling parameters beyond the rig's
    defaults. Returns the prompts of A and B."""
    prompts = _before_the_row(rig, **a_params)
    rig.step("large")  # B's first step, with A's look-ahead row; A's return arrives meanwhile
    return prompts


def _before_the_row(rig: Rig, **a_params: Any) -> tuple[list[int], list[int]]:
    """_answered_return up to the large model's step that runs A's row."""
    pa, pb = prompts_of([9, 6], seed=61)
    rig.add("A", pa, find_seed([True, True], first=len(pa), p=P), **{"max_tokens": 12, **a_params})
    rig.step("small")  # A to the large model
    rig.drain_until("large", lambda: rig.req("large", "A") is not None, "A's first visit")
    rig.step("large")  # writes A's token at len(pa) and hands back; its look-ahead row is due
    back = rig.take_inbox("small")  # A's hand-back, held until B is on the large model
    rig.add("B", pb, find_seed([True], first=len(pb), p=P), max_tokens=12)
    rig.step("small")  # B to the large model
    rig.drain_until("large", lambda: rig.req("large", "B") is not None, "B's first visit")
    rig.small._handle(peer_msgs(back))
    rig.step("small")  # A defers again: back to the large model, unchanged
    return pa, pb


def test_an_answered_return_writes_the_tokens_and_visits_of_the_ordinary_path(pair, tmp_path, monkeypatch):
    """The scenario with and without look-ahead, traced: with it the return is answered without a
    step (a hit and an answered record for each); both runs write the same tokens by the same models, and the
    trace read with the answered returns gives the same visits, catch-up counts included."""
    runs = {}
    for look_ahead in (True, False):
        trace = tmp_path / str(look_ahead)
        trace.mkdir()
        monkeypatch.setenv(ENV, str(trace))  # read by each engine and subserver as it is built
        rig = Rig(pair, P, launch={"look_ahead": look_ahead})
        try:
            _answered_return(rig)
            assert ("A" in rig.large.engine.ahead) == look_ahead
            rig.pump(lambda rig=rig: all(rig.finished(r) for r in "AB") and not rig.large.engine.reqs
                     and not rig.small.engine.reqs, "A and B finished everywhere")
            rig.settle()
            rig.assert_clean("large")
            rig.assert_clean("small")
            hits = rig.large.engine.stats.look_ahead_hits
            # A's return, and as the sockets deliver maybe a later one
            assert (hits >= 1) == look_ahead and rig.large.stats().look_ahead_hits == hits
            assert sum(s.answered for s in read_trace(str(trace), with_answered=True)) == hits
            # the entry learns which tokens were answered (the launch planner counts them)
            answered = [m for m in rig.msgs if isinstance(m, Tokens) and m.answered]
            assert len(answered) == hits and all(m.model == "large" and len(m.items) == 1 for m in answered)
            assert not any(s.answered for s in read_trace(str(trace)))  # step costs never see them
            tokens = {r: sorted(rig.tokens(r), key=lambda t: t[1]) for r in "AB"}
            runs[look_ahead] = tokens, visit_runs(read_trace(str(trace), with_answered=True))
        finally:
            rig.close()
    assert runs[True] == runs[False]
    # S, L, S, L (the answered return)
    assert [(m, k) for m, k, _ in runs[True][1]["A"][:4]] == [(0, 1), (1, 1), (0, 1), (1, 1)]


def test_an_abort_after_an_answered_return_in_one_drain(pair):
    """The return and the request's Abort reach the large model together: the return is answered from
    the set-aside row while the drain handles it, the Abort drops the request, and nothing is
    committed for it afterwards."""
    rig = Rig(pair, P)
    try:
        pa, _ = _answered_return(rig)
        assert "A" in rig.large.engine.ahead
        # Both in the large model's inbox before it drains, in this order (the Abort placed behind
        # the return by hand: through the socket it could arrive a drain later).
        io = rig.large.io
        wait_until(lambda: bool(io.receive_ready() or io.received), "A's return on the large model")
        io.received.append(Abort("A"))
        rig.large._drain(timeout_ms=0)
        assert "A" not in rig.large.engine.reqs
        assert rig.large.engine.stats.look_ahead_hits == 1
        rig.settle()
        # the large model wrote A's token at len(pa) only: the answered row was never committed
        assert [(m, pos) for m, pos, _ in rig.tokens("A") if m == "large"] == [("large", len(pa))]
        rig.abort("A")
        rig.abort("B")
        rig.settle()
        rig.assert_clean("large")
        rig.assert_clean("small")
    finally:
        rig.close()


def test_the_config_switch_is_checked(pair):
    base = {"models": [{"name": "small", "path": str(pair["small"])}, {"name": "large", "path": str(pair["large"])}],
            "algorithm": {"name": "bernoulli", "p": 0.5}}
    assert GroupConfig.from_dict(base).launch.look_ahead is True
    off = GroupConfig.from_dict({**base, "launch": {"look_ahead": False}})
    assert off.launch.look_ahead is False and off.launch.to_dict()["look_ahead"] is False
    with pytest.raises(ValueError, match="launch.look_ahead"):
        GroupConfig.from_dict({**base, "launch": {"look_ahead": "no"}})


def test_visit_runs_count_the_catch_up_after_a_ridden_row():
    """A look-ahead row computes the large model's own last token in an earlier step (b's), so its
    next visit's first step runs only the small model's tokens: the catch-up read off the trace is
    the one without look-ahead. An answered return is a visit of one token either way."""
    ridden = [Step(1, 0, 1, ["a"], [9]), Step(1, 1, 2, ["b"], [1], ["a"]),  # a's row rides on b's step
              Step(0, 2, 3, ["a"], [2]), Step(0, 3, 4, ["a"], [1]),  # the small model writes two tokens
              Step(1, 4, 5, ["a"], [2]),  # the large model catches up on them, its own token computed
              Step(1, 5, 6, ["b"], [1], ["a"]), Step(0, 6, 7, ["a"], [1]),  # rides again; S defers
              Step(1, 7, 7, ["a"], [1], answered=True)]
    plain = [Step(1, 0, 1, ["a"], [9]), Step(1, 1, 2, ["b"], [1]),
             Step(0, 2, 3, ["a"], [2]), Step(0, 3, 4, ["a"], [1]),
             Step(1, 4, 5, ["a"], [3]),  # its own token and the two
             Step(1, 5, 6, ["b"], [1]), Step(0, 6, 7, ["a"], [1]),
             Step(1, 7, 8, ["a"], [1])]
    assert visit_runs(ridden)["a"] == visit_runs(plain)["a"] == [(1, 1, 8), (0, 2, 1), (1, 1, 2), (0, 1, 0),
                                                                 (1, 1, 0)]


class _Clock:
    """`time` for the subserver and the scheduler: monotonic set by hand, perf_counter as it is."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_pending_time_starts_when_the_look_ahead_row_has_run(pair, monkeypatch):
    """model_pending_seconds counts the time a request is PENDING: on the large model, from when its
    look-ahead row ran (RUNNING here until then), not from the hand-off."""
    clock = _Clock()
    monkeypatch.setattr(subserver, "time", clock)
    monkeypatch.setattr(scheduler, "time", clock)
    rig = Rig(pair, P)
    try:
        _before_the_row(rig)  # the large model handed A back at 100
        a = rig.req("large", "A")
        assert a is not None and a.look_ahead
        clock.now = 103.0
        rig.step("large")  # B's step runs A's row: PENDING from here
        assert a.status is ReqStatus.PENDING
        clock.now = 110.0
        rig.drain_until("large", lambda: rig.large.engine.stats.look_ahead_hits == 1, "A's answered return")
        assert rig.large.pending_seconds == 7.0
    finally:
        rig.close()


def test_the_planner_keeps_look_ahead_on(pair):
    """The planner's chains model look-ahead (tokenrouter/planner/chain.py `answered`): `launch:
    planner` leaves it as the group sets it, and the subservers read it the same."""
    base = {"models": [{"name": "small", "path": str(pair["small"])}, {"name": "large", "path": str(pair["large"])}],
            "algorithm": {"name": "bernoulli", "p": 0.5}}
    for on in (True, False):
        planned = GroupConfig.from_dict({**base, "launch": {"policy": "planner", "look_ahead": on}})
        assert planned.launch.look_ahead is on
        assert GroupConfig.from_dict(planned.to_dict()).launch.look_ahead is on  # as each subserver reads it


# ---- each sampling path: the same events with an answered return as without look-ahead -------------

PATHS = ["logprobs", "penalties", "logit_bias", "min_tokens", "max_tokens", "stop", "json_schema", "trace"]
SCHEMA = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}


def _path(name: str, eos: int, z: int) -> tuple[dict[str, Any], list[str]]:
    """A's sampling parameters on a path, and the stop strings the entry matches (A's second token
    is the answered row's)."""
    return {
        "logprobs": ({"logprobs": 3}, []),
        "penalties": ({"frequency_penalty": 0.6, "presence_penalty": 0.4, "repetition_penalty": 1.3}, []),
        "logit_bias": ({"logit_bias": {7: 4.0, 11: 3.0, z: 2.0}}, []),
        # EOS is masked through the answered row, and taken at the token after it
        "min_tokens": ({"min_tokens": 2, "ignore_eos": False, "logit_bias": {eos: 30.0}}, []),
        "max_tokens": ({"max_tokens": 2}, []),  # the answered row writes the last token
        # every token a 'z': the answered row's completes the stop string, and the entry aborts A
        "stop": ({"logit_bias": {z: 30.0}}, ["zz"]),
        "json_schema": ({"structured_output": StructuredOutput(json=SCHEMA)}, []),  # every row masked
        "trace": ({"trace": True}, []),  # each token's attribution (routing.trace), compared too
    }[name]


Rows = dict[str, list[tuple[Any, ...]]]  # rid -> its token events, or its finishes
Events = tuple[Rows, Rows, tuple[list[tuple[Any, ...]], str | None]]


def _run_path(pair: dict[str, Any], look_ahead: bool, a_params: dict[str, Any],
              stops: list[str], large: dict[str, Any] | None = None) -> tuple[Events, list[float], EngineStats]:
    """The answered-return scenario to the end, the test as the entry: it reassembles A's tokens and,
    on a stop string, aborts A. Returns every token event (model, position, id, whether it has a
    logprob, its top ids) and finish of A and B; with stop strings B's only, A as the entry
    reassembles it up to the stop (what follows depends on when the Abort lands); the events'
    logprobs apart, in that order (a row's float rounding depends on the batch it ran in, and batches
    form as messages arrive); and the large model's engine stats."""
    rig = Rig(pair, P, launch={"look_ahead": look_ahead}, large=large)
    try:
        pa, _ = _answered_return(rig, **a_params)
        assert ("A" in rig.large.engine.ahead) == look_ahead  # A's second token: from its row, unchanged
        params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                                   **{k: v for k, v in a_params.items() if k != "trace"}, "stop": stops})
        entry = Reassembly.of("A", AdmittedPlan(pa, params, 0, {}), rig.large.engine.tokenizer, False)
        placed = 0
        aborted = False

        def over() -> bool:
            nonlocal placed, aborted
            for msg in rig.msgs[placed:]:
                if isinstance(msg, Tokens):
                    for e in msg.items:
                        if e.rid == "A":
                            entry.put(e, msg.model)
            placed = len(rig.msgs)
            entry.drain()
            if entry.stop is not None and not aborted:
                aborted = True
                rig.abort("A")  # as the entry does on a stop string
            # A's tokens come from both models over two connections: its finish may arrive before
            # the other model's last tokens, so A is over when they are all placed.
            done = rig.finished("A")
            a_over = aborted or (bool(done) and len(entry.tokens) == done[0].length - len(pa))
            return (a_over and bool(rig.finished("B"))
                    and not rig.large.engine.reqs and not rig.small.engine.reqs)

        rig.pump(over, "A and B over everywhere")
        rig.settle()
        rig.assert_clean("large")
        rig.assert_clean("small")
        whole = ["B"] if stops else ["A", "B"]
        floats: list[float] = []

        def ids(lp: float | None, top: dict[int, float] | None) -> tuple[bool, list[int] | None]:
            floats.extend(([] if lp is None else [lp]) + ([] if top is None else [top[t] for t in sorted(top)]))
            return lp is not None, None if top is None else sorted(top)

        events = {r: [(model, pos, tok, *ids(lp, top), trace) for model, pos, tok, lp, top, trace in sorted(
            ((m.model, e.pos, e.token, e.logprob, e.top_logprobs, e.trace) for m in rig.msgs
             if isinstance(m, Tokens) for e in m.items if e.rid == r), key=lambda t: t[1])] for r in whole}
        finishes = {r: [(f.model, f.reason, f.stop_reason, f.length, f.handoffs) for f in rig.finished(r)]
                    for r in whole}
        reassembled = [(t.model, t.token, *ids(t.logprob, t.top_logprobs)) for t in entry.tokens]
        return (events, finishes, (reassembled, entry.stop)), floats, rig.large.engine.stats
    finally:
        rig.close()


@pytest.fixture(scope="module")
def eos_and_z(pair) -> tuple[int, int]:
    tokenizer = load_tokenizer(str(pair["large"]))
    (z,) = tokenizer.encode("z")
    return tokenizer.eos_token_id, z


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("path", PATHS)
def test_each_path_writes_the_same_events_with_an_answered_return(pair, eos_and_z, path, temperature):
    """With A on each sampling path, greedy and sampled: the same token events (ids, logprobs) and
    finishes with look-ahead as without, a return answered from a look-ahead row in each, and the
    path taken at that row."""
    a_params, stops = _path(path, *eos_and_z)
    a_params = {**a_params, "temperature": temperature}
    with_it, floats, stats = _run_path(pair, True, a_params, stops)
    without, floats_without, stats_without = _run_path(pair, False, a_params, stops)
    assert with_it == without
    assert floats == pytest.approx(floats_without, abs=1e-4)
    assert stats.look_ahead_hits >= 1 and stats_without.look_ahead_hits == 0
    if not stops:  # an answered sample is counted as the step's it stands for (with a stop, A's end varies)
        assert stats.sampled_tokens == stats_without.sampled_tokens
    events, finishes, (reassembled, stop) = with_it
    n = 9  # A's prompt (_answered_return)
    if path == "logprobs":
        assert all(has_lp and len(top) >= 3 for _, _, _, has_lp, top, _ in events["A"]) and floats
    elif path == "min_tokens":
        assert finishes["A"][0][1:4] == ("stop", None, n + 3) and events["A"][-1][2] == eos_and_z[0]
    elif path == "max_tokens":
        assert finishes["A"][0][:4] == ("large", "length", None, n + 2)  # committed from the answered row
    elif path == "stop":
        assert stop == "zz" and len(reassembled) == 2 and reassembled[1][0] == "large"
    elif path == "json_schema":
        text = load_tokenizer(str(pair["large"])).decode([tok for _, _, tok, *_ in events["A"]])
        assert text.startswith("{"), text
    elif path == "trace":  # each token carries its attribution; the hand-offs' paths are on them
        traces = [ev[-1] for ev in events["A"]]
        assert None not in traces and any(t.path for t in traces)


def test_an_answered_return_on_two_ranks_writes_the_same_events(pair, eos_and_z, temperature=1.0):
    """The answered-return scenario with the large model tensor-parallel over two ranks, A sampled and
    asking for logprobs: the same events with look-ahead as without, a return answered from the row."""
    a_params = {**_path("logprobs", *eos_and_z)[0], "temperature": temperature}
    two = {"tp_size": 2}
    with_it, floats, stats = _run_path(pair, True, a_params, [], large=two)
    without, floats_without, stats_without = _run_path(pair, False, a_params, [], large=two)
    assert with_it == without
    assert floats == pytest.approx(floats_without, abs=1e-4)
    assert stats.look_ahead_hits >= 1 and stats_without.look_ahead_hits == 0
    assert stats.sampled_tokens == stats_without.sampled_tokens
