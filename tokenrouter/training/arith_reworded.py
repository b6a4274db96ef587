"""The arithmetic task asked in other words: held-out problems of the same eight kinds as arith.py
whose questions use templates the training generator never writes ("Compute 47 plus 38.", "A shelf
holds 12 books; 7 more are put on it. How many books are on the shelf?"). Nothing trains on them; they
check that what the student and the routers learned is the task, not one template's wording.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tokenrouter.training import champ
from tokenrouter.training.arith import ITEMS, NAMES, Problem

HELD_OUT = 300
SEED_OFFSET = 104_729  # a generator stream neither arith.split nor arith.training_problems reads


# The questions' templates, per operation (arith_unseen.py asks them with other operands).
SUM = ("Compute {a} plus {b}.", "Find the sum of {a} and {b}.", "Add {a} and {b}.")
DIFFERENCE = ("Subtract {b} from {a}.", "How much is {a} minus {b}?", "Find the difference between {a} and {b}.")
PRODUCT = ("Multiply {a} by {b}.", "Compute {a} times {b}.", "What do you get when you multiply {a} by {b}?")
MORE = "A shelf holds {a} {item}. {name} puts {b} more {item} on it. How many {item} are on the shelf?"
FEWER = "There were {a} {item} in a bag. {name} took out {b}. How many {item} are still in the bag?"
ROWS = "There are {b} rows with {a} {item} in each row. How many {item} are there in total?"
GROUPS = "{b} friends split {ab} {item} so that each gets the same number. How many {item} does each get?"


def _sum(r: random.Random, lo: int, hi: int) -> tuple[str, int]:
    a, b = r.randint(lo, hi), r.randint(lo, hi)
    return r.choice(SUM).format(a=a, b=b), a + b


def _small_sum(r: random.Random) -> tuple[str, int]:
    return _sum(r, 1, 20)


def _big_sum(r: random.Random) -> tuple[str, int]:
    return _sum(r, 10, 99)


def _difference(r: random.Random) -> tuple[str, int]:
    a = r.randint(11, 99)
    b = r.randint(10, a - 1)
    return r.choice(DIFFERENCE).format(a=a, b=b), a - b


def _product(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(2, 12), r.randint(2, 12)
    return r.choice(PRODUCT).format(a=a, b=b), a * b


def _more(r: random.Random) -> tuple[str, int]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 40), r.randint(2, 40)
    return MORE.format(a=a, item=item, name=name, b=b), a + b


def _fewer(r: random.Random) -> tuple[str, int]:
    name, item, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 30)
    a = b + r.randint(1, 40)
    return FEWER.format(a=a, item=item, name=name, b=b), a - b


def _rows(r: random.Random) -> tuple[str, int]:
    item, a, b = r.choice(ITEMS), r.randint(2, 9), r.randint(2, 9)
    return ROWS.format(b=b, a=a, item=item), a * b


def _groups(r: random.Random) -> tuple[str, int]:
    item, a, b = r.choice(ITEMS), r.randint(2, 9), r.randint(2, 9)
    return GROUPS.format(b=b, ab=a * b, item=item), a


KINDS: tuple[Callable[[random.Random], tuple[str, int]], ...] = (
    _small_sum, _big_sum, _difference, _product, _more, _fewer, _rows, _groups)


def split(held_out: int = HELD_OUT, seed: int = 0) -> champ.Split:
    """No training problems; `held_out` reworded problems with distinct questions, the kinds in turn
    (deterministic given the seed)."""
    if held_out < 1:
        raise ValueError(f"held_out must be at least 1, got {held_out}")
    r = random.Random(seed + SEED_OFFSET)
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(50 * held_out):
        if len(out) == held_out:
            break
        text, answer = KINDS[len(out) % len(KINDS)](r)
        if text not in seen:
            seen.add(text)
            out.append(Problem(f"arith-reworded-{len(out)}", text, str(answer), ()))
    if len(out) < held_out:
        raise ValueError(f"cannot draw {held_out} distinct reworded problems")
    return champ.Split([], out)
