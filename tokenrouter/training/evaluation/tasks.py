"""The quality tasks `tokenrouter eval --task` knows: each a seeded train/held-out split of problems
(`prompt`, `answer`, `solutions`) and a scorer of one answer text against its reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from tokenrouter.training import arith, champ
from tokenrouter.training.evaluation.metrics import is_correct


class Task(NamedTuple):
    name: str
    title: str  # for the plot
    held_out: int  # held-out problems available
    split: Callable[[int], tuple[Sequence[Any], Sequence[Any]]]  # seed -> (train, held_out)
    correct: Callable[[str, str], bool]  # (answer text, reference answer) -> right?


TASKS = {
    "champ": Task("champ", "held-out CHAMP problems", champ.HELD_OUT, lambda seed: champ.split(seed=seed),
                  is_correct),
    "arith": Task("arith", "held-out arithmetic and word problems", arith.HELD_OUT,
                  lambda seed: arith.split(seed=seed), arith.number_match),
}


def task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; one of {', '.join(TASKS)}")
    return TASKS[name]
