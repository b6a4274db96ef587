"""The per-token trace (`routing: {"trace": true}`) and one model alone (`routing: {"model": NAME}`),
without HTTP: each algorithm's scores against its own rule on two subservers in this process, and
RoutedLLM's outputs against the Bernoulli router's draws."""

from __future__ import annotations

import statistics

import pytest
from routing_utils import Rig, untrained_routers

from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.routing.bernoulli import routing_draws
from tokenrouter.runtime.messages import AddReq, TokenEvent, Tokens
from tokenrouter.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 7, 23]
N = 40

# The rule each algorithm applies on the small model: whether a score hands the position to the large one.
DEFERS = {
    "citer": lambda s, t: s < t,
    "r2r": lambda s, t: s >= t,
    "co_llm": lambda s, t: s > t,
    "r_stitch": lambda s, t: s >= t,
}
KNOB = {"citer": "tau", "r2r": "threshold", "co_llm": "eta", "r_stitch": "tau"}


@pytest.fixture(scope="module")
def routers(pair_paths, tmp_path_factory):
    return untrained_routers(pair_paths, tmp_path_factory.mktemp("trace-routers"))


def run(rig: Rig, rid: str, routing: dict, trace: bool = True, alone: bool = False) -> list[tuple[str, TokenEvent]]:
    """(writer, event) of each output token of a greedy request, in position order."""
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    rig.send("small" if not alone else "large", AddReq(rid, PROMPT, params, 3, routing, trace, alone))
    rig.pump(lambda: bool(rig.finished(rid)), f"{rid} finished")
    events = [(m.model, e) for m in rig.msgs if isinstance(m, Tokens) for e in m.items if e.rid == rid]
    return sorted(events, key=lambda me: me[1].pos)


def handoffs_of(rig: Rig, rid: str) -> int:
    return rig.finished(rid)[0].handoffs


@pytest.mark.parametrize("kind", ["citer", "r2r", "co_llm", "r_stitch"])
def test_scores_follow_each_algorithms_rule(kind, pair_paths, routers):
    algo = {"name": kind} if kind == "r_stitch" else {"name": kind, "router": str(routers[kind])}
    rig = Rig(pair_paths, 0.0, algorithm=algo)
    try:
        calls = []
        traced = rig.small.algorithm.route_traced
        rig.small.algorithm.route_traced = lambda *a: calls.append(1) or traced(*a)
        # Untraced: the algorithm is never asked for scores and no token carries a trace.
        plain = run(rig, "plain", {}, trace=False)
        assert not calls and all(e.trace is None for _, e in plain)
        # A threshold in the middle of the scores seen, so both models write.
        first = run(rig, "probe", {}, trace=True)
        mid = statistics.median(e.trace.score for m, e in first
                                if m == "small" or e.trace.path[-2:] == ["small", "large"])
        events = run(rig, "t", {KNOB[kind]: mid})
        assert calls
        writers = [m for m, _ in events]
        assert set(writers) == {"small", "large"}, writers
        rule = DEFERS[kind]
        prev = None
        for model, e in events:
            tr = e.trace
            assert tr.threshold == pytest.approx(mid) and tr.score is not None
            if model == "small":
                # small kept its token: its own score did not hand the position away
                assert not rule(tr.score, tr.threshold)
                assert tr.path in ([], ["large", "small"])
            elif tr.path[-2:] == ["small", "large"]:
                # small's score sent this position to large (its token dropped): that score is the one shown
                assert rule(tr.score, tr.threshold)
            else:  # R-Stitch's large model stayed after its previous token: that token's entropy >= tau
                assert kind == "r_stitch" and prev is not None and prev[0] == "large" and prev[1].score >= mid
            if kind == "r_stitch" and tr.path == ["large", "small"] and prev[1].path[-2:] != ["small", "large"]:
                # large handed back: its entropy < tau (at a position handed up to it, the score shown is
                # small's, which sent it there)
                assert prev[0] == "large" and prev[1].score < mid
            prev = (model, tr)
        # Every hand-off shows before the token after it, and nowhere else.
        assert sum(max(0, len(e.trace.path) - 1) for _, e in events) == handoffs_of(rig, "t")
        # Tracing changes nothing of the routing: the same request untraced writes the same tokens.
        again = run(rig, "t-plain", {KNOB[kind]: mid}, trace=False)
        assert [(m, e.token) for m, e in again] == [(m, e.token) for m, e in events]
        # One model alone: no routing decision, so no score; no hand-off.
        alone = run(rig, "alone", {KNOB[kind]: mid}, alone=True)
        assert {m for m, _ in alone} == {"large"} and len(alone) == N
        assert all(e.trace.path == [] and e.trace.score is None for _, e in alone)
        assert handoffs_of(rig, "alone") == 0
        rig.settle()
        for name in ("small", "large"):
            rig.assert_clean(name)
            assert not rig.subs[name].states.live and rig.subs[name].states.traced == 0
    finally:
        rig.close()


def test_routed_llm_trace_is_the_bernoulli_draws(pair_paths):
    group = {"models": [{"name": "small", "path": str(pair_paths["small"]), "kv_cache_tokens": 2048, "page_size": 4},
                        {"name": "large", "path": str(pair_paths["large"]), "kv_cache_tokens": 2048, "page_size": 4}],
             "algorithm": {"name": "bernoulli", "p": 0.3}}
    sp = SamplingParams(max_tokens=N, temperature=0.0, seed=11, ignore_eos=True)
    with RoutedLLM(group) as llm:
        out = llm.generate([PROMPT], sp, routing={"trace": True, "p": 0.4}, use_tqdm=False)[0]
        c = out.outputs[0]
        assert c.trace is not None and len(c.trace) == N
        assert [t.model for t in c.trace] == c.token_models
        first = len(PROMPT)
        draws = routing_draws([11] * N, list(range(first, first + N))).tolist()
        for i, t in enumerate(c.trace):
            # Every position is first sampled on small, whose draw decides who writes it.
            assert t.score == draws[i] and t.threshold == 0.4
            assert t.model == ("large" if draws[i] < 0.4 else "small")
        assert sum(max(0, len(t.handoff) - 1) for t in c.trace) == out.extra["handoffs"] > 0
        assert out.extra["routing"] == {"p": 0.4}  # the runtime's fields are not the algorithm's

        plain = llm.generate([PROMPT], sp, routing={"p": 0.4}, use_tqdm=False)[0].outputs[0]
        assert plain.trace is None and plain.token_ids == c.token_ids

        for name in ("small", "large"):
            alone = llm.generate([PROMPT], sp, routing={"model": name, "trace": True}, use_tqdm=False)[0]
            assert alone.outputs[0].token_models == [name] * N and alone.extra["handoffs"] == 0
            assert all(t.score is None and t.handoff == [] for t in alone.outputs[0].trace)

        with pytest.raises(ValueError, match="trace: must be true or false"):
            llm.generate([PROMPT], sp, routing={"trace": "yes"}, use_tqdm=False)
        with pytest.raises(ValueError, match="model: must be one of"):
            llm.generate([PROMPT], sp, routing={"model": "huge"}, use_tqdm=False)
