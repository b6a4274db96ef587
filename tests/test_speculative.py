"""The speculative algorithm on two Subservers in this process: whoever drafts, the answer is the
verifier's own, token for token (greedy, and sampled with the same seed), drafts are accepted and
rejected, stops inside a run of drafts end the answer where the verifier alone ends it, and no page
leaks on either model."""

from __future__ import annotations

import pytest
from engine_utils import make_engine, prompts_of
from prometheus_client.parser import text_string_to_metric_families
from routing_utils import Rig, build_pair

from tokenrouter.engine.req import Req
from tokenrouter.routing import PeerReq, make_algorithm
from tokenrouter.routing.algorithm import RoutingParamError
from tokenrouter.routing.speculative import Speculative
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.server.metrics import ServerMetrics


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("speculative-models"))


@pytest.fixture
def rigs():
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()


def speculative_rig(rigs: list[Rig], paths, drafter: str, draft_tokens: int = 3, **extra) -> Rig:
    """`drafter` "small": a random model that rarely agrees; "large": the verifier's own weights, which
    agree but where a step's batch shape rounds a near tie the other way."""
    rig = Rig({"small": paths[drafter], "large": paths["large"]}, 0.0,
              algorithm={"name": "speculative", "draft_tokens": draft_tokens}, **extra)
    rigs.append(rig)
    return rig


def alone(path, prompts: list[list[int]], seeds: list[int], **params) -> list[tuple[list[int], str]]:
    """The verifier serving the prompts by itself: each answer's tokens and finish reason."""
    eng = make_engine(path)
    reqs = [eng.add_request(p, SamplingParams(**params), seed=s) for p, s in zip(prompts, seeds)]
    for _ in range(10_000):
        if not eng.has_unfinished():
            break
        eng.step()
    return [(r.output_ids, r.finish_reason or "") for r in reqs]


def serve(rig: Rig, prompts: list[list[int]], seeds: list[int], **params) -> list[tuple[list[int], str, list[str]]]:
    """The group's answers: tokens in position order, finish reason, and which model each token came from."""
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, seed in zip(rids, prompts, seeds):
        rig.add(rid, prompt, seed, **params)
    rig.pump(lambda: all(rig.finished(r) for r in rids) and not rig.small.engine.reqs and not rig.large.engine.reqs,
             "every answer finished on both models", timeout=60)
    rig.settle()
    out = []
    for rid, prompt in zip(rids, prompts):
        events = sorted((pos, tok, model) for model, pos, tok in rig.tokens(rid))
        assert [pos for pos, _, _ in events] == list(range(len(prompt), len(prompt) + len(events))), \
            f"{rid}: positions missing or twice"
        (done,) = rig.finished(rid)
        assert done.length == len(prompt) + len(events), f"{rid}: finished at {done.length}, {len(events)} tokens out"
        out.append(([t for _, t, _ in events], done.reason, [m for _, _, m in events]))
    for name in ("small", "large"):
        rig.assert_clean(name)
    return out


PROMPTS = prompts_of([3, 9, 17, 30], seed=40)
SEEDS = [5, 6, 7, 8]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter", ["small", "large"])
def test_the_answer_is_the_verifiers_own(rigs, paths, drafter, sampled):
    params = dict(max_tokens=24, ignore_eos=True, temperature=0.9 if sampled else 0.0, top_p=0.95 if sampled else 1.0)
    rig = speculative_rig(rigs, paths, drafter)
    got = serve(rig, PROMPTS, SEEDS, **params)
    want = alone(paths["large"], PROMPTS, SEEDS, **params)
    assert [(toks, reason) for toks, reason, _ in got] == want
    stats = rig.large.engine.stats
    drafted = sum(models.count("small") for _, _, models in got)
    assert stats.drafts_verified > 0 and drafted == stats.drafts_accepted
    if drafter == "large":  # the same weights: nearly every draft holds
        assert stats.drafts_accepted >= 0.8 * stats.drafts_verified, (stats.drafts_accepted, stats.drafts_verified)
    else:  # another random model: most are rejected, and the verifier writes the rest
        assert stats.drafts_accepted < stats.drafts_verified
    assert rig.small.engine.stats.drafts_verified == 0
    scraped = {f.name: f for f in text_string_to_metric_families(
        ServerMetrics("pair").render({n: rig.subs[n].stats() for n in ("small", "large")}, 0, 0, None).decode())}
    for name, value in (("draft", stats.drafts_verified), ("accepted", stats.drafts_accepted)):
        samples = {s.labels["model"]: s.value for s in scraped[f"tokenrouter_model_spec_decode_{name}_tokens"].samples
                   if s.name.endswith("_total")}
        assert samples == {"small": 0.0, "large": float(value)}


def test_a_stop_inside_a_run_of_drafts_ends_the_answer_where_the_verifier_ends_it(rigs, paths):
    """A stop token the verifier writes at a position where a draft run holds it (accepted) and where
    max_tokens falls inside a run: the same tokens and finish reasons as alone."""
    base = alone(paths["large"], PROMPTS, SEEDS, max_tokens=24, ignore_eos=True, temperature=0.0)
    stop = base[2][0][7]  # the eighth token of the third answer: an accepted draft's place when run 3 by 3
    params = dict(max_tokens=11, ignore_eos=True, temperature=0.0, stop_token_ids=[stop])
    rig = speculative_rig(rigs, paths, "large", draft_tokens=3)
    got = serve(rig, PROMPTS, SEEDS, **params)
    want = alone(paths["large"], PROMPTS, SEEDS, **params)
    assert [(toks, reason) for toks, reason, _ in got] == want
    assert want[2][1] == "stop" and len(want[2][0]) <= 8 and any(reason == "length" for _, reason in want)


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.5), dict(logprobs=2), dict(min_tokens=4)],
                         ids=["penalty", "logprobs", "min_tokens"])
def test_a_request_whose_logits_are_processed_is_written_by_the_verifier(rigs, paths, params):
    rig = speculative_rig(rigs, paths, "large")
    common = dict(max_tokens=12, ignore_eos=True, temperature=0.0, **params)
    got = serve(rig, PROMPTS[:2], SEEDS[:2], **common)
    want = alone(paths["large"], PROMPTS[:2], SEEDS[:2], **common)
    assert [(toks, reason) for toks, reason, _ in got] == want
    assert all(set(models) == {"large"} for _, _, models in got)
    assert rig.large.engine.stats.drafts_verified == 0


def test_drafts_are_verified_whole_when_the_prefill_is_chunked(rigs, paths):
    """A first visit's prompt and drafts run in chunks of 8: the last chunk keeps every verified row."""
    rig = speculative_rig(rigs, paths, "large", draft_tokens=4, engine={"chunked_prefill_size": 8, "max_running_requests": 8})
    prompts = prompts_of([21, 26], seed=41)
    params = dict(max_tokens=10, ignore_eos=True, temperature=0.0)
    got = serve(rig, prompts, SEEDS[:2], **params)
    assert [(toks, reason) for toks, reason, _ in got] == alone(paths["large"], prompts, SEEDS[:2], **params)
    assert rig.large.engine.stats.drafts_accepted > 0


def test_bad_draft_lengths_and_drafts_the_engine_cannot_verify_are_refused(paths):
    with pytest.raises(RoutingParamError, match="draft_tokens"):
        Speculative.check_request_params({"draft_tokens": 0})
    with pytest.raises(RoutingParamError, match="draft_tokens"):
        Speculative.check_request_params({"draft_tokens": 2.5})
    with pytest.raises(ValueError, match="draft_tokens"):
        make_algorithm("speculative", ["a", "b"], {"draft_tokens": 40})
    with pytest.raises(ValueError, match="two models"):
        Speculative(["a", "b", "c"])
    eng = make_engine(paths["large"])
    req: Req = eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, logit_bias={5: 1.0}), rid="x")
    with pytest.raises(ValueError, match="drafts to verify"):
        eng.receive("x", 3, [4, 5], drafts=2)
    with pytest.raises(ValueError, match="3 drafts"):
        eng.receive("x", 3, [4, 5], drafts=3)
    assert req.drafts == 0
    assert PeerReq(rid="x", suffix=[1], loc=0).draft == 0
