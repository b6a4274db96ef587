"""Threshold calibration and held-out metrics for router heads.

Conventions. A *positive* (label 1) is a token that should go to the large model: divergent for R2R,
"small token not acceptable" for CITER, "the models differ" for Co-LLM. Scores are the router's
probability, sigmoid(head(...)), computed in float32 as at serving time, and each kind compares it to
its threshold with its own rule:

    R2R     route when score >= threshold
    Co-LLM  route when score >  eta
    CITER   route when score <  tau     (score = confidence that the small token is fine)

`calibrate` returns the threshold, in the router's own units and rule, that meets a target recall of
positives (the one routing the fewest tokens that does) or a target share of tokens sent to the large
model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

RULES = (">=", ">", "<")
RULE_OF_KIND = {"r2r": ">=", "co_llm": ">", "citer": "<"}


def _as_tensor(x: Any, dtype: torch.dtype) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t.detach().cpu().flatten().to(dtype)


def routed(scores: torch.Tensor, threshold: float, rule: str) -> torch.Tensor:
    """Which tokens the rule sends to the large model (compared in float32, as the serving code does)."""
    s = _as_tensor(scores, torch.float32)
    if rule == ">=":
        return s >= threshold
    if rule == ">":
        return s > threshold
    if rule == "<":
        return s < threshold
    raise ValueError(f"unknown rule {rule!r}; one of {RULES}")


def auc(scores: Any, labels: Any, higher_is_positive: bool = True) -> float:
    """Area under the ROC curve by the rank (Mann-Whitney) formula, ties given their average rank.
    NaN when one class is empty."""
    s = _as_tensor(scores, torch.float64)
    y = _as_tensor(labels, torch.float64) > 0.5
    if not higher_is_positive:
        s = -s
    n_pos = int(y.sum())
    n_neg = int(y.numel() - n_pos)
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(s, stable=True)
    sorted_s = s[order]
    _, counts = torch.unique_consecutive(sorted_s, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)  # 1-based rank of each tie group's last member
    avg = ends - (counts.to(torch.float64) - 1) / 2
    ranks = torch.empty_like(s)
    ranks[order] = torch.repeat_interleave(avg, counts)
    u = float(ranks[y].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _next(x: float, up: bool) -> float:
    t = torch.tensor(x, dtype=torch.float32)
    return float(torch.nextafter(t, torch.tensor(math.inf if up else -math.inf, dtype=torch.float32)))


def _threshold_routing_top(sorted_desc: torch.Tensor, m: int, rule: str) -> float:
    """The threshold routing exactly the m highest (for >=, >) or m lowest (for <) of the given
    sorted values, ties aside: the one routing the fewest."""
    if rule in (">=", ">"):
        if m <= 0:  # route none
            top = float(sorted_desc[0]) if sorted_desc.numel() else 1.0
            return _next(top, up=True) if rule == ">=" else max(top, 1.0)
        v = float(sorted_desc[m - 1])
        return v if rule == ">=" else _next(v, up=False)
    # rule "<": values sorted ascending here
    if m <= 0:
        low = float(sorted_desc[0]) if sorted_desc.numel() else 0.0
        return min(low, 0.0)
    return _next(float(sorted_desc[m - 1]), up=True)


@dataclass
class Calibration:
    threshold: float
    rule: str
    recall: float  # of positives, on the data calibrated on (NaN without positives)
    precision: float  # NaN when nothing is routed
    large_share: float  # share of all tokens routed
    target_recall: float | None
    target_share: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate(scores: Any, labels: Any, threshold: float, rule: str) -> dict[str, float]:
    """Recall, precision and large share of a threshold; accuracy against the labels."""
    y = _as_tensor(labels, torch.float32) > 0.5
    r = routed(scores, threshold, rule)
    n, n_pos, n_routed = y.numel(), int(y.sum()), int(r.sum())
    tp = int((r & y).sum())
    return {
        "recall": tp / n_pos if n_pos else float("nan"),
        "precision": tp / n_routed if n_routed else float("nan"),
        "large_share": n_routed / n if n else float("nan"),
        "accuracy": int((r == y).sum()) / n if n else float("nan"),
    }


def calibrate(scores: Any, labels: Any = None, target_recall: float | None = None,
              target_share: float | None = None, rule: str = ">=") -> Calibration:
    """The threshold meeting `target_recall` of positives (default 0.95) with the fewest tokens routed
    -- for R2R and Co-LLM the highest threshold, for CITER the lowest tau -- or, with `target_share`,
    the threshold routing that share of all tokens (labels may then be None). Ties can make the
    achieved share larger than asked."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; one of {RULES}")
    if target_recall is not None and target_share is not None:
        raise ValueError("give target_recall or target_share, not both")
    if target_recall is None and target_share is None:
        target_recall = 0.95
    s = _as_tensor(scores, torch.float32)
    if s.numel() == 0:
        raise ValueError("calibrate: no scores (is the held-out split empty?)")
    if target_share is not None:
        if not 0.0 <= target_share <= 1.0:
            raise ValueError(f"target_share must be in [0, 1], got {target_share}")
        pool = s
        m = int(round(target_share * s.numel()))
    else:
        assert target_recall is not None
        if not 0.0 < target_recall <= 1.0:
            raise ValueError(f"target_recall must be in (0, 1], got {target_recall}")
        if labels is None:
            raise ValueError("calibrate: target_recall needs labels")
        y = _as_tensor(labels, torch.float32) > 0.5
        if y.numel() != s.numel():
            raise ValueError(f"calibrate: {s.numel()} scores but {y.numel()} labels")
        pool = s[y]
        m = math.ceil(target_recall * pool.numel() - 1e-9)
    ordered = torch.sort(pool, descending=rule != "<").values
    threshold = _threshold_routing_top(ordered if pool.numel() else s.sort(descending=rule != "<").values, m, rule)
    if labels is not None:
        metrics = evaluate(s, labels, threshold, rule)
    else:
        metrics = {"recall": float("nan"), "precision": float("nan"),
                   "large_share": float(routed(s, threshold, rule).float().mean())}
    return Calibration(threshold=_f32(threshold), rule=rule, recall=metrics["recall"],
                       precision=metrics["precision"], large_share=metrics["large_share"],
                       target_recall=target_recall, target_share=target_share)
