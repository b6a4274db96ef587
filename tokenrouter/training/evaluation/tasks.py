"""The quality tasks `tokenrouter eval --task` knows: each a seeded train/held-out split of problems
(`prompt`, `answer`, `solutions`), a scorer of one answer text against its reference, and the key an
answer's final answer is compared by (outcome labels: did continuing from another token change it?)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from tokenrouter.training import arith, arith_reworded, champ
from tokenrouter.training.evaluation.metrics import answer_key, is_correct


class Task(NamedTuple):
    name: str
    title: str  # for the plot
    held_out: int  # held-out problems available
    split: Callable[[int], tuple[Sequence[Any], Sequence[Any]]]  # seed -> (train, held_out)
    correct: Callable[[str, str], bool]  # (answer text, reference answer) -> right?
    key: Callable[[str], Hashable]  # answer text -> its final answer, comparable across texts
    max_tokens: int  # output tokens an answer gets (as the eval's figures were measured)


TASKS = {
    "champ": Task("champ", "held-out CHAMP problems", champ.HELD_OUT, lambda seed: champ.split(seed=seed),
                  is_correct, answer_key, 96),
    "arith": Task("arith", "held-out arithmetic and word problems", arith.HELD_OUT,
                  lambda seed: arith.split(seed=seed), arith.number_match, arith.last_number, 32),
    # the query-level router fits on the arithmetic task's training problems: reworded ones never train
    "arith_reworded": Task("arith_reworded", "held-out arithmetic asked in other words", arith_reworded.HELD_OUT,
                           lambda seed: (arith.split(seed=seed).train, arith_reworded.split(seed=seed).held_out),
                           arith.number_match, arith.last_number, 32),
}


def task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; one of {', '.join(TASKS)}")
    return TASKS[name]
