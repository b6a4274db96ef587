"""Routing that knows the tasks: extra training problems and a reworded held-out set, the large model's
answers, outcome labels (R2R's method), the oracle bound and a router's match to it, the served operating
point. Tiny random pairs: what is checked is that each label, count and choice is the defined one."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tokenrouter.training import arith, arith_reworded, large_answers
from tokenrouter.training.evaluation.metrics import OracleMatch, forced, nll_under
from tokenrouter.training.evaluation.run import Answers, oracle_scores, score
from tokenrouter.training.evaluation.tasks import task
from tokenrouter.training.labels import build_features
from tokenrouter.training.operating_point import Point, choose, measure, toward_cap
from tokenrouter.training.outcome_labels import OutcomeLabeller


def test_extra_training_problems_never_meet_the_split():
    s = arith.split()
    extra = arith.training_problems(900)
    assert [p.text for p in extra] == [p.text for p in arith.training_problems(900)]
    texts = [p.text for p in extra]
    assert len(set(texts)) == 900
    assert not set(texts) & ({p.text for p in s.held_out} | {p.text for p in s.train})
    assert all(arith.number_match(p.solutions[0], p.answer) for p in extra)
    # 12 x 12 products run out; the other kinds carry on
    assert len(arith.training_problems(1500)) == 1500
    with pytest.raises(ValueError, match="count"):
        arith.training_problems(-1)


def test_reworded_problems_are_new_wordings_with_right_answers():
    held = arith_reworded.split().held_out
    assert len(held) == arith_reworded.HELD_OUT == len({p.text for p in held})
    assert [p.text for p in held] == [p.text for p in arith_reworded.split().held_out]
    seen = {p.text for p in arith.generate(900)} | {p.text for p in arith.training_problems(900)}
    assert not {p.text for p in held} & seen
    assert not any(p.text.startswith(("What is", "Each box holds")) or "and gets" in p.text for p in held)
    for i, p in enumerate(held):
        a, b = (int(x) for x in re.findall(r"\d+", p.text))
        want = {0: a + b, 1: a + b, 2: abs(a - b), 3: a * b, 4: a + b, 5: a - b, 6: a * b, 7: b // a}[i % 8]
        assert int(p.answer) == want, p.text
    train, test = task("arith_reworded").split(0)
    assert list(train) == arith.split().train and list(test) == held  # the query router fits on arith's


def test_task_keys_compare_final_answers():
    assert task("arith").key("so 3 + 4 = 7.") == task("arith").key("The answer is 7") != task("arith").key("8")
    assert task("champ").key(r"thus \boxed{ 12 }.") == task("champ").key("we get 12")
    assert task("champ").key("no answer") is None
    assert (task("arith").max_tokens, task("champ").max_tokens) == (32, 96)


def test_forced_gives_the_nll_and_the_greedy_tokens(hf_models):
    model = hf_models["llama"]
    prompts, outputs = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]]
    got = forced(model, prompts, outputs, batch_size=2)
    assert [f.nll_sum for f in got] == nll_under(model, prompts, outputs, batch_size=2)
    for p, o, f in zip(prompts, outputs, got):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + o])).logits[0]
        assert f.greedy == logits[len(p) - 1:len(p) - 1 + len(o)].argmax(-1).tolist()


def test_oracle_match_counts_hand_offs_against_the_labels():
    m = OracleMatch.of([[True, False, True, False], [False, True]], [[1, 2, 3, 4], [5, 6]], [[1, 9, 8, 4], [5, 7]])
    assert (m.routed, m.critical, m.hits) == (3, 3, 2)
    assert m.precision == m.recall == 2 / 3
    assert math.isnan(OracleMatch.of([[False]], [[1]], [[1]]).precision)


@pytest.fixture(scope="module")
def hf_pair(pair_paths):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(pair_paths[k], dtype=torch.float32).eval()
            for k in ("small", "large")}


def test_oracle_writes_where_the_small_model_would_not(hf_pair):
    small, large = hf_pair["small"], hf_pair["large"]
    prompts = [[3, 4, 5], [6, 7]]
    outputs = []
    for p in prompts:  # the large model's greedy answers, by repeated forwards
        ids = list(p)
        for _ in range(6):
            with torch.no_grad():
                ids.append(int(large(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        outputs.append(ids[len(p):])
    ans = Answers(outputs, [["large"] * 6] * 2, ["", ""], 0.0)
    t = task("arith")
    problems = [arith.Problem("a", "x", "1", ()), arith.Problem("b", "y", "2", ())]
    scores, match = score(ans, prompts, outputs, problems, large, small, t)
    # every position of the large model's own answer is its greedy token: the oracle's labels there are
    # exactly where the small model's greedy token differs
    small_greedy = [f.greedy for f in forced(small, prompts, outputs)]
    differ = sum(a != b for g, o in zip(small_greedy, outputs) for a, b in zip(g, o))
    assert (match.routed, match.critical, match.hits) == (12, differ, differ)
    oracle = oracle_scores(ans, scores, small, prompts)
    assert sum(s.large_tokens for s in oracle) == differ
    assert [s._replace(large_tokens=0) for s in oracle] == [s._replace(large_tokens=0) for s in scores]


def test_outcome_labels_are_the_continuations_answers(pair_paths, hf_pair):
    large_path = pair_paths["large"]
    prompts = [[5, 9, 13, 2 + i] for i in range(3)]
    exchanges = large_answers.answer(large_path, "t", prompts, max_tokens=6)
    assert all(len(e.answer) == 6 for e in exchanges)  # random weights: no EOS in 6 tokens

    def key(_task: str, text: str) -> str:  # the "final answer": the last token written
        return text.split()[-1]

    labeller = OutcomeLabeller(large_path, exchanges, lambda ids: " ".join(map(str, ids)), key, lambda _t: 6,
                               eos=set(), progress=False)
    rows, own = [], []
    for i, e in enumerate(exchanges):
        for j in (1, 3, 5):
            t = len(e.prompt) + j - 1
            rows.append((i, t, e.answer[j]))  # the large model's own token: its continuation is its answer
            own.append(True)
            rows.append((i, t, (e.answer[j] + 7) % 50))
            own.append(False)
    seq, pos, tok = (torch.tensor(c) for c in zip(*rows))
    labels = labeller(seq, pos, tok)
    hf = hf_pair["large"]
    for (i, t, x), mine, got in zip(rows, own, labels.tolist()):
        e = exchanges[i]
        ids = e.ids[:t + 1] + [x]
        while len(ids) < len(e.prompt) + 6:  # the reference: transformers' greedy forward, token by token
            with torch.no_grad():
                ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        want = key("t", " ".join(map(str, ids[len(e.prompt):]))) != key("t", " ".join(map(str, e.answer)))
        assert got == float(want)
        if mine:
            assert got == 0.0
    assert labeller.stats["candidates"] == len(rows)
    with pytest.raises(ValueError, match="not in its answer"):
        labeller(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))


def test_answers_from_worker_processes_are_the_answers_of_one(pair_paths):
    """Sharded across two worker processes, in shards smaller than the prompts, the outputs come back
    in the prompts' order, token for token what one process writes (greedy, per-prompt caps)."""
    from tokenrouter.sampling_params import SamplingParams

    prompts = [[1 + (7 * i + j) % 200 for j in range(3 + i % 5)] for i in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i % 4) for i in range(10)]
    one = large_answers.generate(pair_paths["large"], prompts, params, progress=False, workers=1)
    two = large_answers.generate(pair_paths["large"], prompts, params, progress=False, workers=2, shard=3)
    assert [list(o.outputs[0].token_ids) for o in two] == [list(o.outputs[0].token_ids) for o in one]
    assert [o.prompt_token_ids for o in two] == prompts


def test_features_keep_answer_rows_and_take_outcome_labels(hf_pair):
    small, large = hf_pair["small"], hf_pair["large"]
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    calls = []

    def outcome(seq, pos, tok):
        calls.append((seq.clone(), pos.clone(), tok.clone()))
        return (pos % 2).float()

    f = build_features("r2r", small, large, seqs, top_k=4, progress=False, first_rows=[3, 2], outcome=outcome)
    assert f.pos[f.seq == 0].tolist() == [3, 4, 5, 6] and f.pos[f.seq == 1].tolist() == [2, 3, 4]
    (seq, pos, tok), = calls
    differs = f.differs.bool()
    assert torch.equal(seq, f.seq[differs]) and torch.equal(pos, f.pos[differs]) and torch.equal(tok, f.token[differs])
    assert torch.equal(f.label, torch.where(differs, (f.pos % 2).float(), torch.zeros_like(f.label)))
    assert f.stats["labels"] == "outcome"
    with pytest.raises(ValueError, match="R2R"):
        build_features("citer", small, large, seqs, progress=False, outcome=outcome)


def test_the_served_point_is_the_most_accurate_under_the_cap():
    def pt(value, share, correct):
        return Point("r2r", "threshold", value, share, correct / 10, correct, 10, 100, 1.0)

    points = [pt(0.1, 0.05, 1), pt(0.2, 0.3, 4), pt(0.3, 0.35, 4), pt(0.4, 0.6, 7)]
    assert choose(points, 0.4).value == 0.2  # 0.4 is more accurate but over the cap; ties go to the cheaper
    assert choose(points, 1.0).value == 0.4
    assert choose([pt(0.5, 0.7, 3), pt(0.6, 0.5, 2)], 0.4).value == 0.6  # none under the cap: the cheapest
    with pytest.raises(ValueError, match="max_share"):
        choose(points, 1.5)


def test_refinement_bisects_toward_the_cap_in_logits():
    def pt(value, share):
        return Point("r2r", "threshold", value, share, 0.0, 0, 10, 100, 1.0)

    # R2R routes at or above its threshold: the share falls as the threshold rises
    grid = [pt(0.1, 0.73), pt(1 / (1 + math.exp(1.5)), 0.51), pt(0.5, 0.21), pt(0.9, 0.0)]
    assert toward_cap(grid, 0.4) == pytest.approx(1 / (1 + math.exp(0.75)))  # between 0.51 and 0.21
    assert toward_cap(grid, 0.8) is None and toward_cap(grid[2:], 0.4) is None  # nothing straddles the cap
    assert toward_cap(grid + [pt(1 / (1 + math.exp(0.75)), 0.45)], 0.4) == pytest.approx(1 / (1 + math.exp(0.375)))


def test_operating_points_are_measured_through_the_runtime(pair_paths):
    from tokenrouter.runtime.group_config import GroupConfig

    group = GroupConfig.from_dict({"name": "g", "models": [{"name": "small", "path": str(pair_paths["small"])},
                                                           {"name": "large", "path": str(pair_paths["large"])}],
                                   "algorithm": {"name": "bernoulli", "p": 0.5}})
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    points = measure(group, prompts, ["x", "y"], lambda text, ref: ref == "x", [0.0, 1.0], max_tokens=5)
    assert [(p.param, p.value) for p in points] == [("p", 0.0), ("p", 1.0)]
    assert points[0].share == 0.0 and points[1].share > 0.5
    assert all((p.correct, p.answers, p.accuracy, p.tokens) == (1, 2, 0.5, 10) for p in points)
    # two refinements toward a cap of 0.5: first halfway between p = 0 and p = 1, then toward the cap again
    refined = measure(group, prompts, ["x", "y"], lambda text, ref: ref == "x", [0.0, 1.0], max_tokens=5,
                      max_share=0.5, refinements=2)
    third, fourth = refined[2:]
    assert len(refined) == 4 and third.value == pytest.approx(0.5)
    assert (0.0 < fourth.value < 0.5) if third.share > 0.5 else (0.5 < fourth.value < 1.0)
