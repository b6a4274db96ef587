"""The served operating point, chosen from the front: the algorithm and threshold whose answers are
most often right for what the large model writes.

Each candidate (a router at one threshold) answers validation problems through the real runtime
(RoutedLLM, greedy, one group start per router, the threshold as a per-request routing override), and
gets its accuracy and its large-token share. The served point is the most accurate candidate whose
share is at most `max_share`; among equally accurate ones the cheapest. Accuracy grows with the share,
so the best point under the cap lies near it: after the grid, each refinement measures the threshold
halfway (in logits) between the grid's last point under the cap and its first point over it. (Accuracy divided by share
would pick a lucky answer at a share near zero; a cap on the share is what a user sets.) The
validation problems are training problems the student and the routers never read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.training.on_policy import knob, large_share


@dataclass(frozen=True)
class Point:
    algorithm: str
    param: str
    value: float
    share: float  # of output tokens written by the large model
    accuracy: float
    correct: int
    answers: int
    tokens: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(group: GroupConfig, prompts: list[list[int]], references: Sequence[str],
            correct: Callable[[str, str], bool], values: Sequence[float], max_tokens: int,
            log: Callable[[str], None] = lambda m: None, max_share: float = 1.0,
            refinements: int = 0) -> list[Point]:
    """`group` answers every prompt at each of `values` of its algorithm's share knob, then at up to
    `refinements` values toward `max_share` (`toward_cap`)."""
    from tokenrouter.routed_llm import RoutedLLM

    if len(prompts) != len(references) or not prompts:
        raise ValueError(f"need one reference per prompt and at least one prompt, got {len(prompts)} prompts "
                         f"and {len(references)} references")
    param, _ = knob(group.algorithm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    points = []
    pending = list(values)
    with RoutedLLM(group) as llm:
        entry = llm.entry.algorithm.entry_model
        while pending:
            value = pending.pop(0)
            t0 = time.monotonic()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False,
                                routing={param: value})
            share, tokens = large_share([o.outputs[0].token_models or [] for o in outs], entry)
            right = sum(correct(o.outputs[0].text, ref) for o, ref in zip(outs, references))
            p = Point(group.algorithm, param, value, share, right / len(prompts), right, len(prompts), tokens,
                      time.monotonic() - t0)
            log(f"{p.algorithm} {param}={value:.6g}: large share {share:.3f}, accuracy {p.accuracy:.3f} "
                f"({right}/{len(prompts)}, {p.seconds:.1f} s)")
            points.append(p)
            if not pending and len(points) < len(values) + refinements:
                nxt = toward_cap(points, max_share)
                pending += [] if nxt is None else [nxt]
    return points


def toward_cap(points: Sequence[Point], max_share: float) -> float | None:
    """The knob value halfway, in logits, between the point of highest share at or under `max_share`
    and the point of lowest share over it; None when no two points straddle the cap or the halfway
    value was measured already. Knob values are probabilities (thresholds on sigmoid scores, or a
    routing probability), so logits space them evenly in the router's own score."""
    under = [p for p in points if p.share <= max_share]
    over = [p for p in points if p.share > max_share]
    if not under or not over:
        return None
    lo, hi = max(under, key=lambda p: p.share), min(over, key=lambda p: p.share)
    value = shifted(lo.value, (logit(hi.value) - logit(lo.value)) / 2)
    return None if any(math.isclose(value, p.value, rel_tol=1e-9, abs_tol=1e-12) for p in points) else value


def logit(p: float) -> float:
    q = min(max(p, 1e-7), 1 - 1e-7)
    return math.log(q / (1 - q))


def shifted(threshold: float, offset: float) -> float:
    """A sigmoid-score threshold moved by `offset` in logit space."""
    if offset == 0:
        return threshold
    return 1 / (1 + math.exp(-(logit(threshold) + offset)))


def choose(points: Sequence[Point], max_share: float) -> Point:
    """The most accurate point with share <= max_share (ties: the lower share); with none under the
    cap, the point of lowest share."""
    if not points:
        raise ValueError("no operating points to choose from")
    if not 0.0 <= max_share <= 1.0:
        raise ValueError(f"max_share must be in [0, 1], got {max_share}")
    under = [p for p in points if p.share <= max_share]
    if not under:
        return min(points, key=lambda p: p.share)
    return min(under, key=lambda p: (-p.correct / p.answers, p.share))
