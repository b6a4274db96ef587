"""Per-answer quality measures of a routed output, against the large model.

Each answer yields one `AnswerScore`; a system's figures are sums over answers (not means of means),
so that mixing answers of two systems (query-level routing) gives exact totals.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class AnswerScore(NamedTuple):
    tokens: int  # output tokens
    large_tokens: int  # of those, written by the large model
    nll_sum: float  # sum over output tokens of -log p_large(token | prompt, previous output)
    agree: int  # length of the common prefix with the large model's greedy answer
    correct: bool  # the final answer matches the reference


class Totals(NamedTuple):
    answers: int
    tokens: int
    large_share: float
    nll: float  # mean per output token
    agreement: float  # common-prefix tokens over output tokens
    accuracy: float
    correct: int  # answers right
    accuracy_low: float  # the accuracy's 95% Wilson score interval
    accuracy_high: float

    @classmethod
    def of(cls, scores: Sequence[AnswerScore]) -> Totals:
        n = max(1, sum(s.tokens for s in scores))
        right = sum(bool(s.correct) for s in scores)
        low, high = wilson(right, len(scores))
        return cls(len(scores), sum(s.tokens for s in scores), sum(s.large_tokens for s in scores) / n,
                   sum(s.nll_sum for s in scores) / n, sum(s.agree for s in scores) / n,
                   right / max(1, len(scores)), right, low, high)


def wilson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (scipy); (nan, nan) without trials."""
    if trials == 0:
        return float("nan"), float("nan")
    from scipy.stats import binomtest

    ci = binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(diff[0]) if diff.numel() else n


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:/\d+)?")


def final_answer(text: str) -> str | None:
    """The last \\boxed{...} of the text, else its last number; None when it has neither."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _norm(s: str) -> str:
    return re.sub(r"[\s$]|\\[,!;]", "", s).rstrip(".").replace("\\left", "").replace("\\right", "").lower()


def is_correct(text: str, reference: str) -> bool:
    got = final_answer(text)
    return got is not None and bool(reference) and _norm(got) == _norm(reference)


@torch.no_grad()
def nll_under(model: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
              batch_size: int = 4) -> list[float]:
    """Per answer: the sum of the output tokens' negative log-likelihoods under `model` (a causal LM
    returning .logits), given the prompt and the output before each token. Right-padded batches."""
    sums: list[float] = []
    for i in range(0, len(prompts), batch_size):
        rows = [list(p) + list(o) for p, o in zip(prompts[i:i + batch_size], outputs[i:i + batch_size])]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r)
            mask[j, :len(r)] = 1
        logp = F.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
        # position t predicts token t+1; the output's tokens sit at [len(prompt), len(row))
        tok_lp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        for j, (p, o) in enumerate(zip(prompts[i:i + batch_size], outputs[i:i + batch_size])):
            sums.append(-float(tok_lp[j, len(p) - 1:len(p) - 1 + len(o)].sum()))
    return sums
