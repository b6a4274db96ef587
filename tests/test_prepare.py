"""The embedded default pair: CHAMP split, the student's pieces, `tokenrouter prepare` in its
reduced CI setting on the real SmolLM2, the served default answering a chat request (and, before the
pair is prepared, SmolLM2 alone at once, then the switch to the pair, or why not), and `eval`.

The quick pair's student has trained for four steps: its text is noise. What the tests check of it is
the plumbing (shared tokenizer, routers bound to the pair, caching, serving, evaluation), not quality;
docs/QUALITY.md has the full pair's figures.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from server_utils import ServerProcess

from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.training import arith, champ
from tokenrouter.training.evaluation.metrics import (
    AnswerScore,
    Totals,
    common_prefix,
    final_answer,
    is_correct,
    nll_under,
)
from tokenrouter.training.evaluation.query_router import QueryRouter, route_top
from tokenrouter.training.evaluation.run import EvalSettings, evaluate, table, threshold_grid, write
from tokenrouter.training.operating_point import shifted
from tokenrouter.training.student import (
    StudentSettings,
    carve,
    chat_texts,
    distillation_loss,
    initial_student,
    projected_embedding,
    teacher_targets,
)


# ---- pieces ---------------------------------------------------------------------------------------
def test_champ_split_is_disjoint_and_seeded():
    a, b = champ.split(seed=0), champ.split(seed=0)
    assert [p.ident for p in a.held_out] == [p.ident for p in b.held_out]
    assert len(a.held_out) == champ.HELD_OUT and len(a.train) + len(a.held_out) == len(champ.problems())
    assert not {p.ident for p in a.train} & {p.ident for p in a.held_out}
    assert [p.ident for p in champ.split(seed=1).held_out] != [p.ident for p in a.held_out]
    with pytest.raises(ValueError, match="held_out"):
        champ.split(held_out=0)


class _Template:
    def apply_chat_template(self, msgs, tokenize=False):
        return "|".join(m["content"] for m in msgs)


def test_router_text_comes_from_the_other_end_of_the_student_order():
    probs = champ.split().train[:3]
    front, back = list(chat_texts(_Template(), probs, 0)), list(chat_texts(_Template(), probs, 0, reverse=True))
    assert back == front[::-1] and len(front) == sum(len(p.solutions) for p in probs)


def test_projected_embedding_keeps_the_top_directions():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(32, 32, generator=g))[0]
    spectrum = torch.cat([torch.linspace(5, 2, 8), torch.full((24,), 0.05)])  # 8 strong directions, 24 weak
    e = torch.randn(500, 32, generator=g) * spectrum @ basis.T
    p = projected_embedding(e, 8)
    assert p.shape == (500, 8)
    # distances between tokens survive the projection up to one scale
    d_full, d_proj = torch.pdist(e[:50]), torch.pdist(p[:50])
    assert torch.corrcoef(torch.stack([d_full, d_proj]))[0, 1] > 0.95


def test_operating_point_settings_reselect_without_retraining():
    from tokenrouter.training.prepare import PrepareSettings, answered_problems, selection_problems

    base, other = PrepareSettings(), PrepareSettings(selection_problems=32, max_share=0.5)
    for kind in ("citer", "r2r", "co_llm"):
        assert base.router_key(kind) == other.router_key(kind) and base.key() != other.key()
    # the routers read the large model's answers: more answers retrain them
    assert base.router_key("r2r") != PrepareSettings(arith_answers=1000).router_key("r2r")
    assert base.answers_key() != PrepareSettings(champ_answers=40).answers_key()
    # validation problems are training problems, the last ones: never held-out, never the query baseline's,
    # never answered for training
    ids = {p.ident for p in selection_problems(base)}
    split = arith.split(seed=base.student.seed)
    assert len(ids) == base.selection_problems and ids <= {p.ident for p in split.train}
    assert not ids & {p.ident for p in split.train[:EvalSettings().query_train_problems]}
    answered = answered_problems(base)
    texts = {p.text for p in answered["arith"]}
    assert len(answered["arith"]) == base.arith_answers and len(answered["champ"]) == base.champ_answers
    assert not texts & {p.text for p in split.held_out} and not texts & {p.text for p in split.train}
    assert not {p.ident for p in answered["champ"]} & {p.ident for p in champ.split(seed=base.student.seed).held_out}
    for bad, match in (({"router_arith_answers": 900}, "leave answers"), ({"max_share": 0.0}, "max_share"),
                       ({"selected_kinds": ("x",)}, "selected_kinds"), ({"selection_offsets": ()}, "offsets")):
        with pytest.raises(ValueError, match=match):
            PrepareSettings(**bad)


def test_answers_split_between_the_student_and_the_routers():
    from tokenrouter.training.large_answers import Exchange
    from tokenrouter.training.prepare import PrepareSettings, split_answers

    s = PrepareSettings(arith_answers=5, router_arith_answers=2, champ_answers=3, router_champ_answers=1)
    ex = [Exchange("arith", [i], [i], str(i)) for i in range(5)] + [Exchange("champ", [i], [i], "") for i in range(3)]
    student, routers = split_answers(s, ex)
    assert [(e.task, e.prompt) for e in student] == [("arith", [0]), ("arith", [1]), ("arith", [2]),
                                                      ("champ", [0]), ("champ", [1])]
    assert [(e.task, e.prompt) for e in routers] == [("arith", [3]), ("arith", [4]), ("champ", [2])]


def test_student_settings_are_checked():
    with pytest.raises(ValueError, match="num_heads"):
        StudentSettings(hidden_size=100, num_heads=3).validate()
    with pytest.raises(ValueError, match="kd_weight"):
        StudentSettings(kd_weight=1.5).validate()
    with pytest.raises(ValueError, match="layers"):
        StudentSettings(layers=(2, 1)).validate()
    with pytest.raises(ValueError, match="train_sequences"):
        StudentSettings(train_sequences=2, batch_size=4).validate()
    assert StudentSettings().key() == StudentSettings().key() != StudentSettings(steps=1).key()
    assert StudentSettings().key() != StudentSettings(layers=(0, 1, 2, 29)).key()


def test_carved_student_is_the_teachers_layers(hf_models):
    teacher = hf_models["llama"]
    n = teacher.config.num_hidden_layers
    ids = torch.tensor([[3, 9, 4, 17, 5]])
    whole = carve(teacher, list(range(n)))
    with torch.no_grad():
        assert torch.equal(whole(ids).logits, teacher(ids).logits)
    last = carve(teacher, [n - 1])
    assert last.config.num_hidden_layers == 1 and teacher.config.num_hidden_layers == n
    for (name, got), want in zip(last.model.layers[0].state_dict().items(),
                                 teacher.model.layers[n - 1].state_dict().values()):
        assert torch.equal(got, want), name
    assert torch.equal(last.lm_head.weight, teacher.lm_head.weight)
    with pytest.raises(ValueError, match="layers"):
        carve(teacher, [n])
    # the carved student trains its layers and norms; the embedding (tied to the head) stays the teacher's
    student = initial_student(teacher, StudentSettings(layers=(0,)))
    assert not student.get_input_embeddings().weight.requires_grad
    assert all(p.requires_grad for name, p in student.named_parameters() if "embed" not in name)


def test_teacher_targets_are_the_top_k_and_the_loss_reads_them(hf_models):
    teacher = hf_models["llama"]
    seqs = torch.randint(0, teacher.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    t = teacher_targets(teacher, seqs, 5, bf16=False, progress=False, batch_size=2)
    with torch.no_grad():
        full = torch.log_softmax(teacher(seqs[:, :-1]).logits.float(), -1)
    assert t.logprobs.shape == t.tokens.shape == (3, 8, 5)
    assert torch.allclose(t.logprobs, full.topk(5, -1).values, atol=1e-5)
    assert torch.equal(full.gather(-1, t.tokens.long()), t.logprobs)
    # a student equal to the teacher: its KD term is the entropy of the renormalised top-k distribution,
    # its data term the teacher's own CE
    loss, ce = distillation_loss(teacher, seqs, t, 1.0, bf16=False)
    p = torch.softmax(t.logprobs, -1)
    assert math.isclose(float(loss.detach()), float(-(p * t.logprobs).sum(-1).mean()), rel_tol=1e-5)
    assert math.isclose(ce, float(torch.nn.functional.nll_loss(full.flatten(0, 1), seqs[:, 1:].reshape(-1))),
                        rel_tol=1e-5)


def test_students_on_the_same_sequences_share_the_teachers_pass(model_paths, tmp_path, monkeypatch):
    """With a targets cache the teacher reads a set of training sequences once, whatever the students'
    shapes; other sequences (or another k) take a pass of their own. The students train on the
    same targets either way."""
    from tokenrouter.training import student

    passes: list[tuple[int, int]] = []
    real = student.teacher_targets

    def counted(teacher, seqs, k, bf16, progress, batch_size=8):
        passes.append((len(seqs), k))
        return real(teacher, seqs, k, bf16, progress, batch_size)

    monkeypatch.setattr(student, "teacher_targets", counted)
    base = StudentSettings(layers=(0,), seq_len=32, batch_size=2, steps=2, train_sequences=2, held_out_sequences=1,
                           quantization=None)
    cache: dict = {}
    for i, s in enumerate([base, StudentSettings(**{**base.__dict__, "layers": (0, 1)}),
                           StudentSettings(**{**base.__dict__, "train_sequences": 4}),
                           StudentSettings(**{**base.__dict__, "top_k": 8}),
                           # the same ids as the base's two sequences of 33, packed as one of 66
                           StudentSettings(**{**base.__dict__, "seq_len": 65, "train_sequences": 1,
                                              "batch_size": 1})]):
        student.train_student(model_paths["llama"], tmp_path / f"s{i}", s, progress=False, targets_cache=cache)
    assert passes == [(2, 32), (4, 32), (2, 8), (1, 32)]
    assert len(cache) == 4
    student.train_student(model_paths["llama"], tmp_path / "alone", base, progress=False)
    assert len(passes) == 5  # no cache: a pass of its own


def test_answers_and_agreement():
    assert final_answer(r"so the total is \boxed{2^{10}} in the end") == "2^{10}"
    assert final_answer("We get 12 and then 3/4.") == "3/4"
    assert final_answer("no digits here") is None
    assert is_correct("The answer is $239$.", "239") and not is_correct("The answer is 238", "239")
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and common_prefix([], [1]) == 0
    t = Totals.of([AnswerScore(10, 2, 5.0, 10, True), AnswerScore(30, 6, 15.0, 3, False)])
    assert t.large_share == 0.2 and t.nll == 0.5 and t.agreement == 13 / 40 and t.accuracy == 0.5
    assert t.correct == 1 and t.accuracy_low < 0.5 < t.accuracy_high


def test_nll_under_matches_a_direct_forward(hf_models):
    model = hf_models["llama"]
    prompts, outputs = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]]
    got = nll_under(model, prompts, outputs, batch_size=2)
    for p, o, s in zip(prompts, outputs, got):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + o])).logits[0].float(), -1)
        want = -sum(float(logp[len(p) - 1 + i, t]) for i, t in enumerate(o))
        assert math.isclose(s, want, rel_tol=1e-4, abs_tol=1e-4)


def test_query_router_learns_a_linear_gain_and_routes_the_top_share():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g)
    gain = x @ torch.tensor([1.0, -2.0, 0.0, 0.5, 0.0, 0.0]) + 0.05 * torch.randn(200, generator=g)
    r = QueryRouter(ridge=0.1).fit(x[:150], gain[:150])
    pred = r.scores(x[150:])
    assert torch.corrcoef(torch.stack([pred, gain[150:]]))[0, 1] > 0.98
    mask = route_top(pred, 0.2)
    assert int(mask.sum()) == 10 and pred[mask].min() >= pred[~mask].max()
    with pytest.raises(ValueError, match="share"):
        route_top(pred, 1.5)


def test_threshold_grid_spreads_around_the_calibrated_value():
    grid = threshold_grid("r2r", 0.3, 5, 2.0)
    assert grid == sorted(grid) and math.isclose(grid[2], 0.3) and 0 < grid[0] < 0.3 < grid[-1] < 1
    assert threshold_grid("r_stitch", None, 2, 2.0) == [0.02, 0.05]
    with pytest.raises(ValueError, match="calibrated"):
        threshold_grid("citer", None, 3, 2.0)


# ---- the reduced prepare, serving it, evaluating it ----------------------------------------------
@pytest.fixture(scope="module")
def quick_pair(tmp_path_factory, smollm2_gguf):
    from tokenrouter.cache_dir import cache_dir
    from tokenrouter.training import prepare

    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("TOKENROUTER_CACHE", str(cache))
    try:
        pair = prepare.prepare(prepare.quick_settings(), progress=False, log=lambda m: None, threads=1)
        assert cache_dir() == cache
        yield cache, pair
    finally:
        mp.undo()


def test_quick_prepare_makes_a_servable_pair(quick_pair, monkeypatch):
    from tokenrouter.training import prepare

    cache, pair = quick_pair
    monkeypatch.setenv("TOKENROUTER_CACHE", str(cache))
    small_cfg = json.loads((pair.small / "config.json").read_text())
    large_cfg = json.loads((pair.large / "config.json").read_text())
    assert small_cfg["vocab_size"] == large_cfg["vocab_size"] == 49152
    assert (pair.small / "tokenizer.json").read_bytes() == (pair.large / "tokenizer.json").read_bytes()
    meta = pair.meta()
    assert meta["student"]["held_out"]["student_ce"] > meta["student"]["held_out"]["teacher_ce"]
    s = prepare.quick_settings()
    assert meta["answers"]["student"] + meta["answers"]["routers"] == s.arith_answers + s.champ_answers
    assert meta["student"]["held_out"]["answer_tokens"] > 0  # measured on the routers' answers
    for kind in prepare.ROUTER_KINDS:
        router = json.loads((pair.routers[kind] / "router.json").read_text())
        assert router["pair"]["small"]["path"] == str(pair.small.resolve())
        assert meta["corpus_thresholds"][kind] == router["threshold"]
        if kind not in s.selected_kinds:  # the quick pair measures the CITER router only
            assert meta["thresholds"][kind] == router["threshold"] and kind not in meta["operating_points"]
            continue
        points = meta["operating_points"][kind]
        assert [p["value"] for p in points] == pytest.approx(
            [shifted(router["threshold"], o) for o in s.selection_offsets], rel=1e-6)
        assert all(p["answers"] == s.selection_problems and p["tokens"] > 0 for p in points)
        assert meta["thresholds"][kind] in [p["value"] for p in points]
    assert json.loads((pair.routers["r2r"] / "router.json").read_text())["training"]["data"]["labels"] == "outcome"
    served = meta["served"]
    assert served["algorithm"] in s.selected_kinds and served["value"] == meta["thresholds"][served["algorithm"]]
    group = GroupConfig.from_yaml(pair.config)
    assert group.names == ["small", "large"] and group.algorithm == served["algorithm"] == "citer"
    assert group.algorithm_params["tau"] == meta["thresholds"]["citer"]

    # cached: a second call trains nothing
    def refuse(*a, **k):
        raise AssertionError("prepare retrained a cached pair")

    monkeypatch.setattr("tokenrouter.training.student.train_student", refuse)
    monkeypatch.setattr("tokenrouter.training.train.train_router", refuse)
    monkeypatch.setattr("tokenrouter.training.prepare.measure", refuse)
    monkeypatch.setattr("tokenrouter.training.large_answers.answer", refuse)
    assert prepare.prepare(prepare.quick_settings(), progress=False, log=lambda m: None) == pair


def test_served_default_pair_answers_a_chat_request(quick_pair):
    cache, _ = quick_pair
    # The pair's R2R router at threshold 0 sends every token to SmolLM2 (the default serves CITER): the
    # quick student writes noise, the large model real text.
    env = {"TOKENROUTER_CACHE": str(cache), "TOKENROUTER_PREPARE": "quick"}
    srv = ServerProcess(["--algorithm", "r2r", "--algorithm-param", "threshold=0"], env=env, startup_timeout=180)
    try:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
            "model": "default", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    finally:
        assert srv.stop() == 0 and not srv.alive_pids()
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["routing"]["tokens_per_model"].get("large", 0) == body["usage"]["completion_tokens"]


# ---- the default served before its pair is prepared ----------------------------------------------
def test_stage_eta_follows_the_stages_done():
    from tokenrouter.training.prepare import remaining_seconds

    expected = {"a": 10.0, "b": 20.0, "c": 30.0}
    assert remaining_seconds(expected, [], ["a", "b", "c"]) == 60.0  # nothing done yet: the measured figures
    assert remaining_seconds(expected, [("a", 20.0)], ["b", "c"]) == 100.0  # twice as slow as measured so far
    assert remaining_seconds(expected, [("a", 5.0), ("b", 10.0)], []) == 0.0


def cache_without_pair(cache: Path, to: Path, drop: Path | None = None) -> Path:
    """The quick pair's cache with no pair made yet (and without `drop`, a path in it): what is left to
    prepare is the last stage (and `drop`'s). Hard links: the preparation writes no file in place."""
    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n in ("pairs", "prepare.lock") or Path(folder, n) == cache / (drop or "")]

    shutil.copytree(cache, to, ignore=ignore, copy_function=os.link)
    return to


CHAT = {"model": "default", "max_tokens": 16, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": "What is 6 times 7?"}]}


def serving_card(srv: ServerProcess) -> dict:
    return httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]


def answered_by(outcome: httpx.Response | Exception, serving: str) -> bool:
    return (isinstance(outcome, httpx.Response) and outcome.status_code == 200
            and outcome.json()["routing"]["serving"] == serving)


def test_default_answers_with_smollm2_at_once_then_switches_to_the_pair(quick_pair, tmp_path):
    """No pair yet: SmolLM2 answers alone while the pair is prepared in the background (here its last
    stage), then the server switches with requests running: every request completes, SmolLM2's
    finish there, later ones run on the pair, and SmolLM2's group stops holding no KV page."""
    cache = cache_without_pair(quick_pair[0], tmp_path / "cache")
    env = {"TOKENROUTER_CACHE": str(cache), "TOKENROUTER_PREPARE": "quick"}
    # SmolLM2's steps on one thread: on a small machine the pair's start gets the other cores.
    srv = ServerProcess(["--grace-period", "5", "--no-share-cores"], env=env, startup_timeout=180, log_dir=tmp_path)
    outcomes: list[httpx.Response | Exception] = []  # every request's, in the order they ended
    stop = threading.Event()

    def client() -> None:  # back to back, so requests are running whenever the switch comes
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            while not stop.is_set() and len(outcomes) < 300:
                try:
                    outcomes.append(http.post("/v1/chat/completions", json=CHAT))
                except httpx.HTTPError as e:
                    outcomes.append(e)

    def until(done: Callable[[dict], bool]) -> dict:
        card = serving_card(srv)
        while not done(card["serving"]["pair"]) and card["serving"]["pair"]["state"] != "failed" \
                and time.monotonic() < deadline:
            time.sleep(0.5)
            card = serving_card(srv)
        return card

    clients = [threading.Thread(target=client) for _ in range(2)]
    deadline = time.monotonic() + 300
    try:
        first = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=60).json()
        before = serving_card(srv)
        # The clients start with the pair's start (seconds of spawning and loading), not to slow the preparation.
        until(lambda pair: pair["state"] != "preparing")
        for t in clients:
            t.start()
        card = until(lambda pair: pair["drained"] is not None)
        while not any(answered_by(o, "pair") for o in list(outcomes)) and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        for t in clients:
            t.join(90)
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    finally:
        stop.set()
        assert srv.stop() == 0 and not srv.alive_pids()
    log = srv.log_path.read_text()

    # before: SmolLM2 alone, said by the response and the card, while the pair is on its way
    assert first["choices"][0]["routing"]["tokens_per_model"] == {"smollm2": 16}
    assert first["routing"]["serving"] == "smollm2-alone" and before["members"] == ["smollm2"]
    assert before["serving"]["group"] == "smollm2-alone" and before["serving"]["pair"]["state"] != "failed"
    # across the switch: nothing failed, requests were running on SmolLM2 and ended there, no page left
    assert [o.status_code if isinstance(o, httpx.Response) else repr(o) for o in outcomes] == [200] * len(outcomes)
    pair = card["serving"]["pair"]
    assert card["serving"]["group"] == "pair" and pair["state"] == "serving" and card["members"] == ["small", "large"]
    assert pair["in_flight_at_switch"] >= 1 and pair["drained"] == {"requests": pair["in_flight_at_switch"],
                                                                   "pages_held": 0}
    alone = [o.json()["routing"] for o in outcomes if answered_by(o, "smollm2-alone")]
    on_pair = [o.json()["routing"] for o in outcomes if answered_by(o, "pair")]
    assert len(alone) + len(on_pair) == len(outcomes) and alone and on_pair
    assert all(r["tokens_per_model"] == {"smollm2": 16} for r in alone)
    assert all(set(r["tokens_per_model"]) <= {"small", "large"} and sum(r["tokens_per_model"].values()) == 16
               for r in on_pair)
    assert chunks[-1]["routing"]["serving"] == "pair"
    # the log tells the stages with the ETA, and the switch
    assert "routed pair: [1/1] choose the served operating point (about" in log
    assert "switched to the routed pair" in log and "KV pages held: 0" in log


def test_smollm2_serves_first_only_before_the_pair_is_prepared(quick_pair, tmp_path, monkeypatch, capsys):
    from tokenrouter import cli

    def first(*flags: str) -> tuple | None:
        return cli.default_before_pair(cli.build_parser().parse_args(["serve", *flags]), lambda group: group)

    monkeypatch.setenv("TOKENROUTER_CACHE", str(cache_without_pair(quick_pair[0], tmp_path / "cache")))
    monkeypatch.setenv("TOKENROUTER_PREPARE", "quick")
    alone, upgrade = first()
    assert alone.names == ["smollm2"] and alone.algorithm == "single" and alone.name == "default"
    assert alone.models[0].engine.mem_fraction == cli.ALONE_MEM_FRACTION and upgrade.status.state == "preparing"
    assert "--wait-for-pair" in capsys.readouterr().err
    assert first("--wait-for-pair") is None  # group_from_args prepares the pair first, as before
    with pytest.raises(ValueError, match="--kv-cache-tokens configures one model and has no effect on the embedded"):
        first("--kv-cache-tokens", "4096")
    with pytest.raises(ValueError, match="--wait-for-pair is for the embedded default"):
        first("--model-path", str(tmp_path), "--wait-for-pair")
    monkeypatch.setenv("TOKENROUTER_CACHE", str(quick_pair[0]))  # prepared: the pair serves from the start
    assert first() is None


def test_a_failed_preparation_leaves_smollm2_serving_and_says_why(quick_pair, tmp_path):
    from tokenrouter.training import prepare

    # A file where the CITER router's folder goes: its stage trains the router, then cannot put it there.
    citer = Path("routers") / f"citer-{prepare.quick_settings().router_key('citer')}"
    cache = cache_without_pair(quick_pair[0], tmp_path / "cache", drop=citer)
    (cache / citer).write_text("not a router folder")
    env = {"TOKENROUTER_CACHE": str(cache), "TOKENROUTER_PREPARE": "quick"}
    srv = ServerProcess(["--grace-period", "5"], env=env, startup_timeout=180, log_dir=tmp_path)
    try:
        deadline, card = time.monotonic() + 240, serving_card(srv)
        while card["serving"]["pair"]["state"] == "preparing" and time.monotonic() < deadline:
            time.sleep(0.5)
            card = serving_card(srv)
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=60)
        health = httpx.get(f"{srv.url}/health", timeout=30)
    finally:
        assert srv.stop() == 0 and not srv.alive_pids()
    log = srv.log_path.read_text()

    pair = card["serving"]["pair"]
    assert pair["state"] == "failed" and card["serving"]["group"] == "smollm2-alone"
    assert pair["reason"].startswith("stage 'train the citer router' failed: NotADirectoryError")
    assert f"the routed pair will not serve: {pair['reason']}. SmolLM2 goes on serving alone" in log
    assert r.status_code == 200 and health.status_code == 200 and card["members"] == ["smollm2"]
    assert r.json()["routing"]["serving"] == "smollm2-alone"


def test_eval_reports_every_system(quick_pair, monkeypatch, tmp_path):
    cache, pair = quick_pair
    monkeypatch.setenv("TOKENROUTER_CACHE", str(cache))
    s = EvalSettings(task="arith", problems=2, max_tokens=4, algorithms=("r2r", "r_stitch"), points=1,
                     query_train_problems=2, reference_tokens=16, query_shares=(0.0, 0.5, 1.0))
    results = evaluate(pair, s, progress=False, log=lambda m: None)
    by = {(r.system, r.param): r.totals for r in results}
    small, large = by[("small", "")], by[("large", "")]
    assert large.large_share == 1.0 and large.agreement == 1.0 and small.large_share == 0.0
    assert by[("query", "share=0")] == small and by[("query", "share=1")] == large
    # the oracle writes the large model's answers, with the large model writing only where the small differs
    oracle = by[("oracle", "")]
    assert (oracle.accuracy, oracle.nll, oracle.tokens) == (large.accuracy, large.nll, large.tokens)
    assert 0.0 <= oracle.large_share <= 1.0
    for r in results:
        if r.system in ("r2r", "r_stitch"):  # hand-offs against the oracle's labels, on the system's own answers
            assert r.oracle is not None and r.oracle.routed == round(r.totals.large_share * r.totals.tokens)
            assert 0 <= r.oracle.hits <= min(r.oracle.routed, r.oracle.critical)
    assert 0.0 <= by[("query", "share=0.5")].large_share <= 1.0
    for kind in ("r2r", "r_stitch"):
        (t,) = [r.totals for r in results if r.system == kind]
        assert t.answers == 2 and 0.0 <= t.large_share <= 1.0 and math.isfinite(t.nll)
        assert 0.0 <= t.accuracy_low <= t.accuracy <= t.accuracy_high <= 1.0
    # one point: the served threshold itself, marked
    assert [r.param for r in results if r.system == "r2r"] == [f"{pair.meta()['thresholds']['r2r']:.6g} (served)"]
    write(results, tmp_path, s, pair)
    assert (tmp_path / "quality_vs_cost.png").stat().st_size > 0
    assert "| r2r |" in table(results) and "accuracy 95% CI" in table(results)
    rows = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert rows and all({"accuracy_low", "accuracy_high", "correct"} <= set(r) for r in rows)
    assert {"oracle_precision", "oracle_recall"} <= set(next(r for r in rows if r["system"] == "r2r"))
