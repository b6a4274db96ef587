"""The CHAMP dataset (champ-dataset, MIT): 270 competition-math problems with answers, and about
43,700 LLM-written solutions. Training, evaluation and benchmark workloads all read it from here.

The package is located, never imported: its module has side effects we do not want. Problems are
split by identifier with a seeded draw, so text from a held-out problem (its statement or any of
its solutions) never reaches training.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

INSTRUCTION = "Solve the following problem step by step, and give the final answer at the end.\n\nProblem: "
HELD_OUT = 40  # problems kept out of every training step (evaluation only)


class Problem(NamedTuple):
    ident: str
    text: str
    answer: str
    solutions: tuple[str, ...]  # model-written solution texts

    @property
    def prompt(self) -> str:
        return INSTRUCTION + self.text


class Split(NamedTuple):
    train: list[Problem]
    held_out: list[Problem]


@lru_cache(maxsize=1)
def _raw() -> dict[str, Any]:
    spec = importlib.util.find_spec("champ_dataset")
    if spec is None or spec.origin is None:
        raise RuntimeError("the CHAMP dataset is missing (pip install champ-dataset)")
    return json.loads((Path(spec.origin).parent / "dataset_files" / "v0.json").read_text())


def _solutions(p: dict[str, Any]) -> tuple[str, ...]:
    out = []
    for conv in p.get("conversations", {}).values():
        out.extend(m["text"] for m in conv.get("messages", []) if m.get("role", "").startswith("Model")
                   and m.get("text"))
    return tuple(out)


@lru_cache(maxsize=1)
def problems() -> tuple[Problem, ...]:
    """Every problem, in the dataset's order."""
    raw = _raw()["problems"]
    return tuple(Problem(k, p["_text"], str(p.get("_answer", "")), _solutions(p)) for k, p in raw.items())


def split(held_out: int = HELD_OUT, seed: int = 0) -> Split:
    """Train/held-out split by problem (deterministic given the seed)."""
    allp = problems()
    if not 0 < held_out < len(allp):
        raise ValueError(f"held_out must be between 1 and {len(allp) - 1}, got {held_out}")
    chosen = set(random.Random(seed).sample(range(len(allp)), held_out))
    return Split([p for i, p in enumerate(allp) if i not in chosen], [p for i, p in enumerate(allp) if i in chosen])


def chat_prompts(tokenizer: Any, problems: Sequence[Any]) -> list[list[int]]:
    """Prompt ids of each problem's `prompt` asked as one user turn in the tokenizer's chat template."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False))
            for p in problems]
