"""Benchmark workloads shaped like the paper's, from real text that ships in a PyPI package, and the
random token-id load that vLLM's and SGLang's serving benchmarks use.

CHAMP (champ-dataset, MIT) gives 270 competition-math problems and about 43,700 LLM-written
solutions. Reasoning workloads ask its problems (prompts of about 100 tokens) with long output caps;
the agent workload builds long prompts (about 8192 tokens at paper scale) from its solution texts,
with shorter outputs. Each has a CPU scale of the same shape with smaller caps.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from tokenrouter.training import arith, champ


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompt_tokens: dict[str, int | None]  # per scale; None: the problem as it is (about 100 tokens)
    max_tokens: dict[str, int]  # per scale
    chat: bool = False  # prompts are token ids in the served tokenizer's chat template (build_prompts needs it)


WORKLOADS = {
    "reasoning-low": Workload("reasoning-low", "math problems, low-effort reasoning",
                              {"paper": None, "cpu": None}, {"paper": 2048, "cpu": 128}),
    "reasoning-high": Workload("reasoning-high", "math problems, high-effort reasoning",
                               {"paper": None, "cpu": None}, {"paper": 8192, "cpu": 512}),
    "agent": Workload("agent", "long agent-like contexts from solution transcripts",
                      {"paper": 8192, "cpu": 1024}, {"paper": 1024, "cpu": 64}),
    # What the default pair is prepared and judged on: a user asking held-out arithmetic in chat.
    "arith": Workload("arith", "held-out arithmetic and word problems as chat turns (the default pair's task)",
                      {"paper": None, "cpu": None}, {"paper": 32, "cpu": 32}, chat=True),
}


def problems() -> list[str]:
    return [p.text for p in champ.problems()]


def solution_texts() -> list[str]:
    return [t for p in champ.problems() for t in p.solutions]


def output_lengths(cap: int, n: int, range_ratio: float = 1.0, seed: int = 0) -> list[int]:
    """Per-request output caps, uniform over [ceil(range_ratio * cap), cap] and seeded, so every system
    of a comparison gets the same ones (SGLang's bench_serving draws lengths this way with
    --random-range-ratio). Reasoning answers end at EOS after very different lengths; 1.0 gives every
    request the whole cap."""
    if not 0.0 < range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in (0, 1], got {range_ratio}")
    if cap < 1:
        raise ValueError(f"the output cap must be >= 1, got {cap}")
    low = max(1, math.ceil(range_ratio * cap))
    rng = random.Random(seed * 7919 + 17)
    return [rng.randint(low, cap) for _ in range(n)]


def build_prompts(workload: str, scale: str, n: int, seed: int = 0,
                  tokenizer: Any = None) -> tuple[list[str] | list[list[int]], int]:
    """n prompts and the output cap. With a tokenizer, long prompts are cut to an exact token count;
    without one, to 4 characters per token. A chat workload needs the tokenizer and gives token ids."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; available: {', '.join(WORKLOADS)}")
    if scale not in ("paper", "cpu"):
        raise ValueError(f"scale must be 'paper' or 'cpu', got {scale!r}")
    w = WORKLOADS[workload]
    rng = random.Random(seed)
    if w.chat:
        if tokenizer is None:
            raise ValueError(f"workload {workload!r} asks in the chat template: it needs the served tokenizer")
        held_out = arith.split(seed=0).held_out  # the problems `tokenrouter eval --task arith` scores
        rng.shuffle(held_out)
        return champ.chat_prompts(tokenizer, [held_out[i % len(held_out)] for i in range(n)]), w.max_tokens[scale]
    target = w.prompt_tokens[scale]
    if target is None:
        pool = problems()
        rng.shuffle(pool)
        return [champ.INSTRUCTION + pool[i % len(pool)] for i in range(n)], w.max_tokens[scale]
    texts = solution_texts()
    prompts = []
    for _ in range(n):
        parts: list[str] = []
        length = 0
        while length < target * 5:  # more than enough characters, cut below
            t = texts[rng.randrange(len(texts))]
            parts.append(t)
            length += len(t)
        body = "\n\n".join(parts)
        if tokenizer is not None:
            ids = tokenizer.encode(body)[:target - 32]
            body = tokenizer.decode(ids)
        else:
            body = body[:(target - 32) * 4]
        prompts.append("Here is a log of previous attempts:\n\n" + body + "\n\nContinue from where it stops.")
    return prompts, w.max_tokens[scale]


RANDOM = "random"  # not a text workload: prompts of random token ids (random_id_prompts)


def random_id_prompts(n: int, input_len: int, tokenizer: Any, seed: int = 0) -> list[list[int]]:
    """n prompts of exactly input_len token ids drawn uniformly (seeded) from the tokenizer's vocabulary,
    special tokens left out: the load of `vllm bench serve --dataset-name random` and SGLang's
    `bench_serving --dataset-name random-ids`, sent as token ids so its length is exact."""
    if input_len < 1:
        raise ValueError(f"the random prompt length must be >= 1, got {input_len}")
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(seed)
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(n)]
