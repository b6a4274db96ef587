"""Generated arithmetic and short word problems with integer answers: a quality task meant to tell
the default pair's models apart (CHAMP is too hard for both: SmolLM2 solves 2 of 40).

Eight kinds, drawn in turn: addition of numbers up to 20 and of two-digit numbers, two-digit
subtraction, multiplication up to 12 x 12, and word problems that add, subtract, multiply and divide
exactly. The generator is a seeded `random.Random`, so a seed gives the same problems everywhere;
the split is by question text (held-out questions never appear in the training part, which fits the
query-level baseline). An answer is scored by exact match of the last number it writes against the
integer answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from fractions import Fraction

from tokenrouter.training import champ

HELD_OUT = 300  # held-out problems (a 95% Wilson interval at accuracy 0.5 is +-0.056 wide)
TRAIN = 200
EXTRA_SEED = 7919  # training_problems draws from seed + this (a generator stream the split never reads)
INSTRUCTION = "Answer with the final number only. "  # before the question: SmolLM2 follows it more often

NAMES = ("Tom", "Sara", "Ali", "Mia", "Ken", "Lea", "Omar", "Ana")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "cards")


class Problem(champ.Problem):
    """A CHAMP-shaped problem (the eval reads both alike) with this task's instruction; the answer is
    an integer and `solutions` holds one worked solution (the query-level baseline's reference)."""

    __slots__ = ()

    @property
    def prompt(self) -> str:
        return INSTRUCTION + self.text


BARE = "What is {a} {op} {b}?"


def _bare(op: str, lo: int, hi: int) -> Callable[[random.Random], tuple[str, int, str]]:
    def make(r: random.Random) -> tuple[str, int, str]:
        a, b = r.randint(lo, hi), r.randint(lo, hi)
        if op == "-":  # a positive difference, both operands in range
            a = r.randint(lo + 1, hi)
            b = r.randint(lo, a - 1)
        c = {"+": a + b, "-": a - b, "*": a * b}[op]
        return BARE.format(a=a, op=op, b=b), c, solution(a, op, b, c)
    return make


# The word problems' questions (arith_unseen.py asks them with other operands).
WORD_ADD = "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
WORD_SUB = "{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?"
WORD_MUL = "Each box holds {a} {item}. How many {item} are in {b} boxes?"
WORD_DIV = "{ab} {item} are shared equally among {b} children. How many {item} does each child get?"


def solution(a: int, op: str, b: int, c: int) -> str:
    return f"{a} {op} {b} = {c}. The answer is {c}."


def _word_add(r: random.Random) -> tuple[str, int, str]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 40), r.randint(2, 40)
    return WORD_ADD.format(name=name, item=item, a=a, b=b), a + b, solution(a, "+", b, a + b)


def _word_sub(r: random.Random) -> tuple[str, int, str]:
    name, item, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 30)
    a = b + r.randint(1, 40)
    return WORD_SUB.format(name=name, item=item, a=a, b=b), a - b, solution(a, "-", b, a - b)


def _word_mul(r: random.Random) -> tuple[str, int, str]:
    item, a, b = r.choice(ITEMS), r.randint(2, 9), r.randint(2, 9)
    return WORD_MUL.format(item=item, a=a, b=b), a * b, solution(a, "*", b, a * b)


def _word_div(r: random.Random) -> tuple[str, int, str]:
    item, a, b = r.choice(ITEMS), r.randint(2, 9), r.randint(2, 9)
    return WORD_DIV.format(ab=a * b, item=item, b=b), a, solution(a * b, "/", b, a)


KINDS: tuple[Callable[[random.Random], tuple[str, int, str]], ...] = (
    _bare("+", 1, 20), _bare("+", 10, 99), _bare("-", 10, 99), _bare("*", 2, 12),
    _word_add, _word_sub, _word_mul, _word_div)


def generate(count: int, seed: int = 0) -> list[Problem]:
    """`count` problems with distinct questions, the kinds in turn (deterministic given the seed)."""
    r = random.Random(seed)
    seen: set[str] = set()
    out: list[Problem] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 50 * count:
            raise ValueError(f"cannot draw {count} distinct problems")
        text, answer, solution = KINDS[len(out) % len(KINDS)](r)
        if text in seen:
            continue
        seen.add(text)
        out.append(Problem(f"arith-{len(out)}", text, str(answer), (solution,)))
    return out


def split(held_out: int = HELD_OUT, train: int = TRAIN, seed: int = 0) -> champ.Split:
    """Disjoint training and held-out problems (distinct questions), deterministic given the seed."""
    if held_out < 1 or train < 0:
        raise ValueError(f"held_out must be at least 1 and train at least 0, got {held_out} and {train}")
    problems = generate(held_out + train, seed)
    random.Random(seed + 1).shuffle(problems)
    return champ.Split(problems[held_out:], problems[:held_out])


def training_problems(count: int, seed: int = 0) -> list[Problem]:
    """`count` more training problems from the same kinds under another seed, none of whose questions
    is in `split(seed=seed)`: what the student and the routers learn the task from (the split's own
    training problems fit the query-level baseline and choose the served operating point). The kinds
    come in turn; a kind whose questions run out (12 x 12 products) leaves the rotation."""
    if count < 0:
        raise ValueError(f"count must be at least 0, got {count}")
    s = split(seed=seed)
    seen = {p.text for p in s.held_out} | {p.text for p in s.train}
    r = random.Random(seed + EXTRA_SEED)
    kinds = list(KINDS)
    out: list[Problem] = []
    while len(out) < count:
        if not kinds:
            raise ValueError(f"cannot draw {count} training problems distinct from the split's")
        kind = kinds[len(out) % len(kinds)]
        for _ in range(200):
            text, answer, solution = kind(r)
            if text not in seen:
                seen.add(text)
                out.append(Problem(f"arith-train-{len(out)}", text, str(answer), (solution,)))
                break
        else:
            kinds.remove(kind)
    return out


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> Fraction | None:
    """The value of the last number written in the text (thousands commas allowed), or None."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def number_match(text: str, answer: str) -> bool:
    """Exact match of the text's last number with the integer answer."""
    got = last_number(text)
    return got is not None and got == Fraction(answer)
