"""The speculative algorithm on two Subservers in this process: whoever drafts, the answer is the
verifier's own, token for token (greedy, and sampled with the same seed), drafts are accepted and
rejected, stops inside a run of drafts end the answer where the verifier alone ends it, and no page
leaks on either model. The lossy knob (FLy's loose verification) keeps a rejected draft exactly where
its rule says."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from engine_utils import make_engine, prompts_of
from prometheus_client.parser import text_string_to_metric_families
from routing_utils import Rig, build_pair

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.model_runner import StepOutputSpec
from tokenrouter.engine.req import LooseVerify, Req
from tokenrouter.routing import PeerReq, make_algorithm
from tokenrouter.routing.algorithm import RoutingParamError
from tokenrouter.routing.speculative import MAX_DRAFT_TOKENS, DraftRun, Speculative
from tokenrouter.runtime.entry.reassembly import TokenOut
from tokenrouter.runtime.messages import Tokens
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.server.generation import trace_entries
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


def speculative_rig(rigs: list[Rig], paths, drafter: str, draft_tokens: int = 3, draft_schedule: str = "constant",
                    **extra) -> Rig:
    """`drafter` "small": a random model that rarely agrees; "large": the verifier's own weights, which
    agree but where a step's batch shape rounds a near tie the other way."""
    rig = Rig({"small": paths[drafter], "large": paths["large"]}, 0.0,
              algorithm={"name": "speculative", "draft_tokens": draft_tokens, "draft_schedule": draft_schedule},
              **extra)
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


@pytest.mark.parametrize("draft_tokens,lengths,max_tokens", [(4, [21, 26], 10), (9, [5, 12], 24)],
                         ids=["prompt-in-chunks", "run-over-a-chunk"])
def test_drafts_are_verified_whole_when_the_prefill_is_chunked(rigs, paths, draft_tokens, lengths, max_tokens):
    """Chunks of 8: a first visit's prompt and drafts run in chunks, the last keeping every verified row;
    a run of 9 drafts (10 rows that cannot split, more than any step's budget) runs whole, over the
    budget, rather than never."""
    rig = speculative_rig(rigs, paths, "large", draft_tokens=draft_tokens,
                          engine={"chunked_prefill_size": 8, "max_running_requests": 8})
    prompts = prompts_of(lengths, seed=41 if draft_tokens == 4 else 42)
    params = dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    got = serve(rig, prompts, SEEDS[:2], **params)
    assert [(toks, reason) for toks, reason, _ in got] == alone(paths["large"], prompts, SEEDS[:2], **params)
    assert rig.large.engine.stats.drafts_accepted >= (1 if draft_tokens == 4 else 9)


@pytest.mark.parametrize("drafter", ["small", "large"])
def test_the_heuristic_schedule_lengthens_runs_kept_whole_and_shortens_cut_ones(rigs, paths, drafter):
    """The verifier's own weights keep nearly every draft: from runs of 1 the heuristic grows them, so
    fewer hand-offs than drafting 1 each time. A random drafter is cut at once: from runs of 4 it
    shrinks them, so fewer drafts verified (and rejected) than drafting 4 each time. Answers unchanged."""
    start = 1 if drafter == "large" else 4
    params = dict(max_tokens=24, ignore_eos=True, temperature=0.0)
    want = alone(paths["large"], PROMPTS, SEEDS, **params)
    counts = {}
    for schedule in ("constant", "heuristic"):
        rig = speculative_rig(rigs, paths, drafter, draft_tokens=start, draft_schedule=schedule)
        got = serve(rig, PROMPTS, SEEDS, **params)
        assert [(toks, reason) for toks, reason, _ in got] == want, schedule
        assert not rig.small.algorithm.runs, "a finished request's drafting state is freed"
        counts[schedule] = (rig.small.stats().handoffs_sent, rig.large.engine.stats.drafts_verified)
    (sent_c, verified_c), (sent_h, verified_h) = counts["constant"], counts["heuristic"]
    if drafter == "large":
        assert sent_h <= 0.6 * sent_c, counts
    else:
        assert verified_h < 0.7 * verified_c, counts


@pytest.mark.parametrize("fly", [1.0, 0.5])
def test_the_heuristic_schedule_moves_a_run_within_its_bounds(fly):
    """The drafter's hand-backs alone: a run kept whole grows by two up to MAX_DRAFT_TOKENS, a cut one
    shrinks by one down to 1 (2 under FLy, whose gate needs drafts after a kept one); the constant
    schedule never moves."""
    spec = Speculative(["s", "l"], draft_tokens=4, draft_schedule="heuristic", fly_entropy_threshold=fly)
    constant = Speculative(["s", "l"], draft_tokens=4, fly_entropy_threshold=fly)
    for alg in (spec, constant):
        alg.params_of["r"] = alg.resolve_request(None)
        alg.runs["r"] = DraftRun(verified=10, length=4)

    def hand_back(alg: Speculative, kept: int) -> int:
        run = alg.runs["r"]
        run.sent = run.length
        alg.receive(PeerReq(rid="r", suffix=[7], loc=run.verified + kept), "s")  # as the verifier hands back
        return run.length

    assert [hand_back(spec, 0) for _ in range(5)] == ([3, 2, 1, 1, 1] if fly == 1.0 else [3, 2, 2, 2, 2])
    assert spec.runs["r"].verified == 15 and spec.runs["r"].sent == 0
    grown = [hand_back(spec, spec.runs["r"].length) for _ in range(9)]
    assert grown[:3] == ([3, 5, 7] if fly == 1.0 else [4, 6, 8]) and grown[-1] == MAX_DRAFT_TOKENS
    assert hand_back(spec, MAX_DRAFT_TOKENS - 1) == MAX_DRAFT_TOKENS - 1  # one short of whole: cut
    assert {hand_back(constant, k) for k in (0, 4, 2)} == {4}
    spec.receive(PeerReq(rid="r", suffix=[], loc=0, finished=True), "s")  # a finish notice is no hand-back
    assert spec.runs["r"].verified > 0


def test_bad_draft_lengths_and_drafts_the_engine_cannot_verify_are_refused(paths):
    with pytest.raises(RoutingParamError, match="draft_schedule"):
        Speculative.check_request_params({"draft_schedule": "adaptive"})
    with pytest.raises(ValueError, match="draft_schedule"):
        make_algorithm("speculative", ["a", "b"], {"draft_schedule": 3})
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


def test_requests_that_start_under_load_are_written_by_the_verifier_alone(paths):
    """disable_by_batch_size 2: of four prompts given at once, the first starts as the one live
    request and is drafted; the others start beside it and the verifier writes every token, on every
    core for its small steps (the drafter then holds nothing: each subserver publishes what it holds
    on the step board, watched here). The answers are the verifier's own."""
    import threading
    import time

    from tokenrouter.engine.step_board import StepBoard
    from tokenrouter.routed_llm import RoutedLLM

    cfg = {"models": [{"name": "small", "path": str(paths["large"]), "kv_cache_tokens": 4096},
                      {"name": "large", "path": str(paths["large"]), "kv_cache_tokens": 4096}],
           "algorithm": {"name": "speculative", "draft_tokens": 3, "disable_by_batch_size": 2}}
    params = dict(max_tokens=64, ignore_eos=True, temperature=0.0)
    with RoutedLLM(cfg) as llm:
        board = StepBoard(llm.entry.pool.board_name, 0)
        held = board.held
        most: list[float] = [0.0, 0.0]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                most[:] = [max(most[i], held[i]) for i in (0, 1)]
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(**params), use_tqdm=False,
                                timeout=120)
        finally:
            done.set()
            watcher.join()
        stats = llm.entry.stats()
        deadline = time.monotonic() + 10
        while held[:2].any() and time.monotonic() < deadline:  # each subserver's next pass publishes its 0
            time.sleep(0.01)
        assert most[0] == 1 and most[1] >= 3 and not held[:2].any(), (most, held[:2])
        board.close()
    models = [o.outputs[0].token_models for o in outs]
    assert "small" in models[0] and all(set(m) == {"large"} for m in models[1:]), models
    assert [list(o.outputs[0].token_ids) for o in outs] == [t for t, _ in alone(paths["large"], PROMPTS, SEEDS,
                                                                                  **params)]
    assert stats["large"].drafts_verified > 0 and stats["large"].threaded_steps > 0
    # N = 1: every request is the verifier's alone; past the prompts' prefill (more rows than a
    # shared step takes) each of its steps runs on every core, the drafter holding nothing
    cfg["algorithm"]["disable_by_batch_size"] = 1
    with RoutedLLM(cfg) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(**params), use_tqdm=False,
                            timeout=120)
        large = llm.entry.stats()["large"]
    assert all(set(o.outputs[0].token_models) == {"large"} for o in outs)
    assert large.steps - len(PROMPTS) <= large.threaded_steps < large.steps, (large.threaded_steps, large.steps)
    assert Speculative(["a", "b"]).alone_at(100) is None
    at_three = Speculative(["a", "b"], disable_by_batch_size=3)
    assert [at_three.alone_at(n) for n in (1, 2, 3, 9)] == [None, None, "b", "b"]
    for bad in (0, -1, 2.0, "2", True):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            make_algorithm("speculative", ["a", "b"], {"disable_by_batch_size": bad})


def greedy_next(path, tokens: list[int]) -> tuple[int, float]:
    """The verifier's greedy token after `tokens`, and the normalised entropy of its top 3 there."""
    eng = make_engine(path)
    eng.add_request(tokens, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    out = eng.forward_step()
    assert out is not None and out.logits is not None
    logp = torch.log_softmax(out.logits[0].topk(3).values.double(), dim=-1)
    return out.token_ids[0], float(-(logp.exp() * logp).sum() / math.log(3))


@pytest.mark.parametrize("spec", [StepOutputSpec(logits=True), StepOutputSpec()], ids=["logits", "screened"])
def test_a_loose_rule_keeps_a_rejected_draft_only_where_the_verifier_is_unsure_and_agrees_after(paths, spec):
    """Drafts [x, y, ...] where the verifier writes t0 != x first and y after x: exactly, nothing is
    kept; loosely, x is kept when the verifier's entropy there is above the rule's and the next
    `window` drafts agree, and then its own token after y follows."""
    prompt = PROMPTS[1]
    t0, unsure = greedy_next(paths["large"], prompt)
    x = (t0 + 1) % 64
    y, _ = greedy_next(paths["large"], prompt + [x])
    z, _ = greedy_next(paths["large"], prompt + [x, y])
    assert 0.0 < unsure < 1.0

    def verify(drafts: list[int], loose: LooseVerify | None) -> tuple[int, list[int]]:
        """(drafts kept, the output after the step: kept drafts then the verifier's token)."""
        cfg = EngineConfig(model_path=str(paths["large"]), kv_cache_tokens=1024, page_size=4, device="cpu")
        eng = Engine(cfg, outputs=spec)
        req = eng.add_request(prompt + drafts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                              prompt_len=len(prompt), drafts=len(drafts), loose=loose)
        out = eng.forward_step()
        assert out is not None and out.accepted is not None
        # the verifier's own spec (speculative asks for nothing) takes the screened head's exact top
        assert (out.logits is None) == (spec == StepOutputSpec() and eng.model.lm_head_screened is not None)
        assert eng.accept_drafts(req, 0.0) == out.accepted[0]
        eng.check_integrity()
        assert req.loose is None  # spent by the verification
        return out.accepted[0], req.output_ids + [out.token_ids[0]]

    assert verify([x, y], None) == (0, [t0])
    assert verify([x, y], LooseVerify(0.0, 1)) == (2, [x, y, z])
    assert verify([x, y], LooseVerify(unsure - 1e-3, 6)) == (2, [x, y, z])  # the window: as many as follow
    assert verify([x, y], LooseVerify(unsure + 1e-3, 1)) == (0, [t0])  # sure enough of t0
    assert verify([x, (y + 1) % 64], LooseVerify(0.0, 1)) == (0, [t0])  # the next draft disagrees
    assert verify([x], LooseVerify(0.0, 1)) == (0, [t0])  # no draft after it to agree


@pytest.fixture(scope="module")
def near(paths, tmp_path_factory) -> Path:
    """A drafter that agrees with the verifier part of the time: its weights plus noise (a fifth of each
    matrix's spread). The random small model agrees almost never, so FLy's window never holds for it."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("speculative-near") / "near"
    shutil.copytree(paths["large"], folder)
    weights = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    save_file({k: v + 0.2 * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v
               for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_the_lossy_knob_keeps_drafts_the_exact_verifier_rejects(rigs, paths, near):
    """A drafter that agrees now and then, through the group: with FLy's gate wide open more of its
    drafts are kept than exactly, every answer is whole and no page leaks; the answers are no longer
    only the verifier's."""
    params = dict(max_tokens=24, ignore_eos=True, temperature=0.0)
    exact = Rig({"small": near, "large": paths["large"]}, 0.0, algorithm={"name": "speculative", "draft_tokens": 3})
    rigs.append(exact)
    serve(exact, PROMPTS, SEEDS, **params)
    loose = Rig({"small": near, "large": paths["large"]}, 0.0,
                algorithm={"name": "speculative", "draft_tokens": 3, "fly_entropy_threshold": 0.0,
                           "fly_window_size": 1})
    rigs.append(loose)
    got = serve(loose, PROMPTS, SEEDS, **params)
    want = alone(paths["large"], PROMPTS, SEEDS, **params)
    a, b = exact.large.engine.stats, loose.large.engine.stats
    assert b.drafts_accepted > a.drafts_accepted, (b.drafts_accepted, a.drafts_accepted)
    assert [toks for toks, _, _ in got] != [toks for toks, _ in want]


def test_bad_fly_parameters_are_refused_naming_them():
    for field, bad in (("fly_entropy_threshold", 1.5), ("fly_entropy_threshold", "high"), ("fly_window_size", 0),
                       ("fly_window_size", 2.0)):
        with pytest.raises(RoutingParamError, match=field):
            Speculative.check_request_params({field: bad})
    with pytest.raises(ValueError, match="fly_window_size"):
        make_algorithm("speculative", ["a", "b"], {"fly_window_size": 40})
    # a run of one draft has none after it to agree: the knob would do nothing, so it is refused
    with pytest.raises(ValueError, match="fly_entropy_threshold.*draft_tokens"):
        make_algorithm("speculative", ["a", "b"], {"fly_entropy_threshold": 0.3})
    one = Speculative(["a", "b"], draft_tokens=1)
    with pytest.raises(RoutingParamError, match="fly_entropy_threshold.*draft_tokens"):
        one.resolve_request({"fly_entropy_threshold": 0.3})
    assert one.resolve_request({"fly_entropy_threshold": 0.3, "draft_tokens": 2})["fly_window_size"] == 6
    assert Speculative.check_request_params({"fly_entropy_threshold": 0.3, "fly_window_size": 2}) == \
        {"fly_entropy_threshold": 0.3, "fly_window_size": 2}


def test_a_traced_answer_shows_each_rejected_run_where_the_verifier_replaced_it(rigs, paths):
    """The random drafter, traced: each token the verifier writes after rejecting drafts carries the run
    it replaced (the first rejected draft is not the verifier's token there), accepted drafts come as
    the drafter's own tokens, and the runs add up to the verifier's rejections."""
    rig = speculative_rig(rigs, paths, "small")
    rids = [f"t{i}" for i in range(len(PROMPTS))]
    for rid, prompt, seed in zip(rids, PROMPTS, SEEDS):
        rig.add(rid, prompt, seed, trace=True, max_tokens=20)
    rig.pump(lambda: all(rig.finished(r) for r in rids) and not rig.large.engine.reqs, "traced answers", timeout=60)
    rig.settle()
    events = [(m.model, e) for m in rig.msgs if isinstance(m, Tokens) for e in m.items]
    runs = [(model, e) for model, e in events if e.trace is not None and e.trace.rejected]
    assert runs and all(model == "large" and e.trace.rejected[0] != e.token for model, e in runs)
    assert all(not e.trace.rejected for model, e in events if model == "small")
    stats = rig.large.engine.stats
    assert sum(len(e.trace.rejected) for _, e in runs) == stats.drafts_verified - stats.drafts_accepted
    model, first = runs[0]
    (entry,) = trace_entries([TokenOut(first.rid, first.token, model, "", trace=first.trace)], Decoder())
    assert (entry["rejected"], entry["rejected_text"]) == (first.trace.rejected, Decoder().decode(first.trace.rejected))


class Decoder:
    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))
