"""The eval's quality tasks: the generated arithmetic task, its scorer, the task registry,
and the accuracy's Wilson interval."""

from __future__ import annotations

import math
import operator
import re
from fractions import Fraction

import pytest

from tokenrouter.training import arith, arith_unseen, champ
from tokenrouter.training.evaluation.metrics import PairedDifference, is_correct, wilson
from tokenrouter.training.evaluation.tasks import task


def test_arith_is_seeded_disjoint_and_sized():
    a, b = arith.split(seed=0), arith.split(seed=0)
    assert a == b and len(a.held_out) == arith.HELD_OUT and len(a.train) == arith.TRAIN
    assert not {p.text for p in a.train} & {p.text for p in a.held_out}
    assert len({p.ident for p in a.train + a.held_out}) == arith.HELD_OUT + arith.TRAIN
    assert [p.text for p in arith.split(seed=1).held_out] != [p.text for p in a.held_out]
    # every kind is there, in about equal numbers
    bare = [p for p in a.held_out if p.text.startswith("What is")]
    assert 0.4 < len(bare) / len(a.held_out) < 0.6
    with pytest.raises(ValueError, match="held_out"):
        arith.split(held_out=0)


def test_arith_answers_are_right():
    for p in arith.generate(400, seed=3):
        assert p.prompt == arith.INSTRUCTION + p.text and p.answer.lstrip("-").isdigit()
        m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", p.text)
        if m:
            a, op, b = int(m[1]), m[2], int(m[3])
            assert int(p.answer) == {"+": a + b, "-": a - b, "*": a * b}[op] and int(p.answer) > 0
        # the worked solution ends on the answer, so the scorer accepts it
        assert arith.number_match(p.solutions[0], p.answer)


def test_number_match_takes_the_last_number_exactly():
    assert arith.number_match("7 + 5 = 12", "12") and arith.number_match("The answer is 1,200.", "1200")
    assert arith.number_match("12.0", "12") and arith.number_match("It is -3", "-3")
    assert not arith.number_match("12 apples, 13 in all", "12") and not arith.number_match("twelve", "12")
    assert not arith.number_match("12.5", "12") and arith.last_number("") is None


def test_tasks_know_their_splits_and_scorers():
    t = task("champ")
    assert t.held_out == champ.HELD_OUT
    assert [p.ident for p in t.split(0)[1]] == [p.ident for p in champ.split().held_out]
    assert t.correct is is_correct
    t = task("arith")
    assert t.held_out == arith.HELD_OUT and t.split(0)[1] == arith.split().held_out and t.correct("so 4", "4")
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        task("nope")


def test_wilson_interval():
    # the closed form: (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    z = 1.959963984540054
    for k, n in ((0, 40), (2, 40), (150, 300), (300, 300)):
        p = k / n
        mid, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        lo, hi = wilson(k, n)
        assert lo == pytest.approx((mid - half) / (1 + z * z / n), abs=1e-9)
        assert hi == pytest.approx((mid + half) / (1 + z * z / n), abs=1e-9)
        assert lo <= p <= hi
    assert all(math.isnan(x) for x in wilson(0, 0))
    # 300 items at accuracy 0.5: about +-0.056
    lo, hi = wilson(150, 300)
    assert hi - lo == pytest.approx(0.112, abs=0.002)


def test_unseen_operations_are_new_disjoint_and_asked_in_both_wordings():
    """No operation of the unseen parts is one a model or a choice learns from (or the old held-out
    part's), either way round where it commutes; validation and test share none; both wordings ask
    the same operations; the answers are right; operands reach past the training ranges."""
    seen = arith_unseen.seen_operations()
    plain, reworded = arith_unseen.split(), arith_unseen.split(reworded=True)
    assert plain == arith_unseen.split() and len(plain.validation) == 200 and len(plain.test) == 300
    ops = {part: [arith_unseen.operation_of(p) for p in getattr(plain, part)] for part in ("validation", "test")}
    assert not {o.key for o in ops["validation"] + ops["test"]} & seen
    assert not {o.key for o in ops["validation"]} & {o.key for o in ops["test"]}
    assert len({o.key for o in ops["test"]}) == len(ops["test"])
    for part in ("validation", "test"):
        assert [arith_unseen.operation_of(p) for p in getattr(reworded, part)] == ops[part]
        assert [p.text for p in getattr(reworded, part)] != [p.text for p in getattr(plain, part)]
        for p in getattr(plain, part) + getattr(reworded, part):
            o = arith_unseen.operation_of(p)
            assert {str(o.a), str(o.b)} <= set(re.findall(r"\d+", p.text)), (o, p.text)
            assert Fraction(p.answer) == {"+": operator.add, "-": operator.sub, "*": operator.mul,
                                          "/": Fraction}[o.op](o.a, o.b)
    assert max(o.a for o in ops["test"] if o.op == "+") > 99  # arith.py adds numbers below 100
    assert {o.op for o in ops["test"]} == {"+", "-", "*", "/"}
    assert arith_unseen.Operation("+", 3, 9).key == arith_unseen.Operation("+", 9, 3).key
    assert arith_unseen.Operation("-", 9, 3).key != arith_unseen.Operation("-", 3, 9).key


def test_paired_difference_interval_and_mcnemar():
    from scipy.stats import binomtest

    a = [1.0] * 40 + [0.0] * 60
    b = [1.0] * 25 + [0.0] * 15 + [1.0] * 5 + [0.0] * 55  # 15 only a gets right, 5 only b
    d = PairedDifference.of(a, b)
    assert d.difference == pytest.approx(0.10)
    assert d.low < 0.10 < d.high and d.high - d.low < 0.2
    assert d.mcnemar_p == pytest.approx(binomtest(15, 20).pvalue)
    assert PairedDifference.of(a, a) == (0.0, 0.0, 0.0, 1.0)
    assert PairedDifference.of(a, [0.5] * 100).mcnemar_p is None
    with pytest.raises(ValueError, match="equal"):
        PairedDifference.of(a, b[:10])
