"""Arithmetic on operations nothing has seen: the eight kinds of arith.py, with operands that reach past
its ranges, each problem's operation (the operator and its operands, in either order where it
commutes) absent from every problem the student, the routers, the served operating point or the
query-level baseline learn from (arith.training_problems up to SEEN_TRAINING, arith.split's training
part) and from arith.split's held-out part. Each operation is asked in arith.py's wording and in
arith_reworded.py's, so the two wordings of a part hold the same operations.

Two parts with no operation in common: `validation` (every choice is made on it) and `test` (read
once, for the final table).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import NamedTuple

from tokenrouter.training import arith, arith_reworded
from tokenrouter.training.arith import ITEMS, NAMES, Problem

VALIDATION = 200
TEST = 300
SEEN_TRAINING = 2000  # arith.training_problems drawn to rule operations out: more than prepare ever answers
SEED_OFFSET = 611_953  # a generator stream no other arith module reads


class Operation(NamedTuple):
    op: str  # "+", "-", "*", "/"
    a: int
    b: int

    @property
    def key(self) -> tuple[str, int, int]:
        """Equal for the same operation written either way round where it commutes."""
        return (self.op, *sorted((self.a, self.b))) if self.op in "+*" else (self.op, self.a, self.b)

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b, "/": self.a // self.b}[self.op]

    @property
    def solution_text(self) -> str:
        return arith.solution(self.a, self.op, self.b, self.answer)


_SOLUTION = re.compile(r"^(\d+) ([-+*/]) (\d+) = ")


def operation_of(p: Problem) -> Operation:
    """The operation of an arith.py problem, read from its worked solution."""
    m = _SOLUTION.match(p.solutions[0]) if p.solutions else None
    if m is None:
        raise ValueError(f"problem {p.id} has no worked solution to read its operation from")
    return Operation(m.group(2), int(m.group(1)), int(m.group(3)))


def _pair(lo: int, hi: int) -> Callable[[random.Random], tuple[int, int]]:
    return lambda r: (r.randint(lo, hi), r.randint(lo, hi))


def _difference(lo: int, hi: int) -> Callable[[random.Random], tuple[int, int]]:
    def draw(r: random.Random) -> tuple[int, int]:
        a = r.randint(lo + 1, hi)
        return a, r.randint(lo, a - 1)
    return draw


def _quotient(lo: int, hi: int) -> Callable[[random.Random], tuple[int, int]]:
    def draw(r: random.Random) -> tuple[int, int]:
        q, b = r.randint(lo, hi), r.randint(lo, hi)
        return q * b, b
    return draw


class Kind(NamedTuple):
    op: str
    draw: Callable[[random.Random], tuple[int, int]]  # operands, past arith.py's ranges
    ask: Callable[[random.Random, int, int], str]  # arith.py's wording
    reword: Callable[[random.Random, int, int], str]  # arith_reworded.py's wording


def _bare(op: str) -> Callable[[random.Random, int, int], str]:
    return lambda r, a, b: arith.BARE.format(a=a, op=op, b=b)


def _one_of(templates: tuple[str, ...]) -> Callable[[random.Random, int, int], str]:
    return lambda r, a, b: r.choice(templates).format(a=a, b=b)


def _story(template: str) -> Callable[[random.Random, int, int], str]:
    return lambda r, a, b: template.format(name=r.choice(NAMES), item=r.choice(ITEMS), a=a, b=b, ab=a)


def _shares(template: str) -> Callable[[random.Random, int, int], str]:  # a is the total, b the parts
    return lambda r, a, b: template.format(item=r.choice(ITEMS), ab=a, b=b)


KINDS = (
    Kind("+", _pair(21, 60), _bare("+"), _one_of(arith_reworded.SUM)),
    Kind("+", _pair(100, 199), _bare("+"), _one_of(arith_reworded.SUM)),
    Kind("-", _difference(100, 199), _bare("-"), _one_of(arith_reworded.DIFFERENCE)),
    Kind("*", _pair(2, 25), _bare("*"), _one_of(arith_reworded.PRODUCT)),
    Kind("+", _pair(2, 80), _story(arith.WORD_ADD), _story(arith_reworded.MORE)),
    Kind("-", _difference(2, 90), _story(arith.WORD_SUB), _story(arith_reworded.FEWER)),
    Kind("*", _pair(2, 20), _story(arith.WORD_MUL), _story(arith_reworded.ROWS)),
    Kind("/", _quotient(2, 15), _shares(arith.WORD_DIV), _shares(arith_reworded.GROUPS)),
)


def seen_operations(seed: int = 0) -> set[tuple[str, int, int]]:
    """The operations of every arith.py problem a model or a choice learns from, and of its held-out part."""
    s = arith.split(seed=seed)
    problems = [*s.train, *s.held_out, *arith.training_problems(SEEN_TRAINING, seed=seed)]
    return {operation_of(p).key for p in problems}


class Parts(NamedTuple):
    validation: list[Problem]
    test: list[Problem]


def split(reworded: bool = False, validation: int = VALIDATION, test: int = TEST, seed: int = 0) -> Parts:
    """Both parts in one wording, the kinds in turn; the same operations in both wordings."""
    if validation < 1 or test < 1:
        raise ValueError(f"validation and test must be at least 1, got {validation} and {test}")
    ops = _operations(validation + test, seed)
    r = random.Random(seed + SEED_OFFSET + 1 + int(reworded))  # the wording's own draws (names, templates)
    name = "arith-unseen-reworded" if reworded else "arith-unseen"
    problems = []
    for i, (kind, op) in enumerate(ops):
        text = (kind.reword if reworded else kind.ask)(r, op.a, op.b)
        problems.append(Problem(f"{name}-{i}", text, str(op.answer), (op.solution_text,)))
    return Parts(problems[:validation], problems[validation:])


def _operations(count: int, seed: int) -> list[tuple[Kind, Operation]]:
    seen = seen_operations(seed)
    r = random.Random(seed + SEED_OFFSET)
    out: list[tuple[Kind, Operation]] = []
    for _ in range(200 * count):
        if len(out) == count:
            return out
        kind = KINDS[len(out) % len(KINDS)]
        op = Operation(kind.op, *kind.draw(r))
        if op.key not in seen:
            seen.add(op.key)
            out.append((kind, op))
    raise ValueError(f"cannot draw {count} unseen operations")
