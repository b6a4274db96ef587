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


def answer_key(text: str) -> str | None:
    """The text's final answer, normalised (None when it has none): equal keys, the same answer."""
    got = final_answer(text)
    return None if got is None else _norm(got)


def is_correct(text: str, reference: str) -> bool:
    got = answer_key(text)
    return got is not None and bool(reference) and got == _norm(reference)


class Forced(NamedTuple):
    """One answer teacher-forced through a model."""

    nll_sum: float  # sum over output tokens of -log p(token | prompt, previous output)
    greedy: list[int]  # the model's argmax at each output position


@torch.no_grad()
def forced(model: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
           batch_size: int = 4) -> list[Forced]:
    """Per answer: its NLL under `model` (a causal LM returning .logits) and the model's greedy token at
    each output position, given the prompt and the output before it. Right-padded batches."""
    out: list[Forced] = []
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
        best = logp[:, :-1].argmax(-1)
        for j, (p, o) in enumerate(zip(prompts[i:i + batch_size], outputs[i:i + batch_size])):
            span = slice(len(p) - 1, len(p) - 1 + len(o))
            out.append(Forced(-float(tok_lp[j, span].sum()), best[j, span].tolist()))
    return out


def nll_under(model: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
              batch_size: int = 4) -> list[float]:
    """Per answer: the sum of the output tokens' negative log-likelihoods under `model`."""
    return [f.nll_sum for f in forced(model, prompts, outputs, batch_size)]


class OracleMatch(NamedTuple):
    """A router's decisions against the oracle's labels on the same prefixes: a position is critical
    when the small model's greedy token differs from the large model's there."""

    routed: int  # positions the large model wrote
    critical: int  # positions the oracle would hand to the large model
    hits: int  # both

    @property
    def precision(self) -> float:
        return self.hits / self.routed if self.routed else float("nan")

    @property
    def recall(self) -> float:
        return self.hits / self.critical if self.critical else float("nan")

    @classmethod
    def of(cls, writers: Sequence[Sequence[bool]], small_greedy: Sequence[Sequence[int]],
           large_greedy: Sequence[Sequence[int]]) -> OracleMatch:
        """writers[i][t]: the large model wrote token t of answer i; the greedy tokens of both models
        teacher-forced on that answer."""
        routed = critical = hits = 0
        for w, s, g in zip(writers, small_greedy, large_greedy):
            for large_wrote, a, b in zip(w, s, g):
                routed += large_wrote
                critical += a != b
                hits += large_wrote and a != b
        return cls(routed, critical, hits)


class PairedDifference(NamedTuple):
    """Two systems' accuracies on the same problems: their difference, its 95% paired-bootstrap
    interval, and McNemar's exact two-sided p-value (None where an answer's score is not 0 or 1,
    as for an expected score over random routing)."""

    difference: float
    low: float
    high: float
    mcnemar_p: float | None

    @classmethod
    def of(cls, a: Sequence[float], b: Sequence[float], draws: int = 10_000, seed: int = 0) -> PairedDifference:
        """`a`, `b`: each problem's score (1 right, 0 wrong, or an expectation in between)."""
        import numpy as np
        from scipy.stats import binomtest

        if len(a) != len(b) or not a:
            raise ValueError(f"paired scores need equal, non-zero counts, got {len(a)} and {len(b)}")
        d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
        idx = np.random.default_rng(seed).integers(0, len(d), size=(draws, len(d)))
        means = d[idx].mean(axis=1)
        p = None
        if all(x in (0.0, 1.0) for x in (*a, *b)):
            wins, losses = int((d > 0).sum()), int((d < 0).sum())
            p = float(binomtest(wins, wins + losses).pvalue) if wins + losses else 1.0
        return cls(float(d.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975)), p)
