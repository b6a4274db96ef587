"""On-policy calibration: the threshold at which a routed group, writing freely, sends a target share
of its output tokens to the large model.

Thresholds calibrated on corpus text (training/calibrate.py) do not transfer to free generation: once
the small model has written a few tokens of its own the router's scores move (docs/QUALITY.md). Here
the group itself answers the prompts through the real runtime (RoutedLLM: the small model writes,
the router decides, the large model writes what it is handed) and the share is counted from the
writer of every output token (`CompletionOutput.token_models`).

The search is over the algorithm's `share_knob` (R2R `threshold`, Co-LLM `eta`, CITER `tau`, R-Stitch
`tau`, bernoulli `p`), in logit space: the scores are sigmoid outputs, so equal logit steps move the
share evenly. The share is monotone in the threshold only in expectation, and with greedy decoding
each measurement is deterministic but jumpy (one routed token changes the rest of the answer). The
search therefore keeps an honest bracket: its low end is a measured threshold whose share was below
the target and its high end one whose share was above, each new probe replaces the end on its side,
and the result is the probe measured closest to the target (never an interpolation). Every probe
reruns all prompts with the threshold as a per-request routing override, so the group starts once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenrouter.routing import algorithm_class
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams

LOGIT_LIMIT = 16.0  # thresholds stay within sigmoid(+-16), ~1e-7 from 0 and 1
LOGIT_RESOLUTION = 1e-3  # a bracket narrower than this (in logits) is a jump in the share: stop


@dataclass(frozen=True)
class SearchSettings:
    target_share: float  # of output tokens written by models other than the entry (small) model
    tolerance: float = 0.025  # done when the measured share is within this of the target
    max_iterations: int = 10  # probes (each one answers every prompt)
    step: float = 2.0  # logits of the first step away from the start while looking for a bracket
    max_tokens: int = 96  # per answer, greedy

    def __post_init__(self) -> None:
        if not 0.0 <= self.target_share <= 1.0:
            raise ValueError(f"target_share must be in [0, 1], got {self.target_share}")
        if not 0.0 < self.tolerance < 1.0:
            raise ValueError(f"tolerance must be in (0, 1), got {self.tolerance}")
        if self.max_iterations < 1:
            raise ValueError(f"max_iterations must be at least 1, got {self.max_iterations}")
        if not self.step > 0:
            raise ValueError(f"step must be positive, got {self.step}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Probe:
    value: float  # the threshold, in the algorithm's own units
    share: float  # measured large share of the output tokens
    tokens: int  # output tokens counted
    seconds: float


@dataclass
class OnPolicyCalibration:
    algorithm: str
    param: str
    target_share: float
    tolerance: float
    value: float  # the probe measured closest to the target
    share: float
    reached: bool  # |share - target| <= tolerance
    probes: list[Probe] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "param": self.param, "target_share": self.target_share,
                "tolerance": self.tolerance, "value": self.value, "share": self.share, "reached": self.reached,
                "probes": [vars(p) for p in self.probes]}

    def summary(self) -> str:
        verdict = "within" if self.reached else "NOT within"
        return (f"{self.algorithm} {self.param}={self.value:.6g}: large share {self.share:.3f}, {verdict} "
                f"{self.tolerance:g} of the target {self.target_share:g} after {len(self.probes)} probe(s)")


def knob(algorithm: str) -> tuple[str, bool]:
    """The algorithm's share knob: (per-request parameter, whether raising it routes more)."""
    cls = algorithm_class(algorithm)
    if cls.share_knob is None:
        raise ValueError(f"algorithm {algorithm} has no threshold to calibrate (share_knob); calibrate knows "
                         "algorithms that declare one, e.g. r2r, citer, co_llm, r_stitch, bernoulli")
    param, rises = cls.share_knob
    if param not in cls.request_params:
        raise ValueError(f"algorithm {algorithm}: share_knob {param!r} is not one of its request_params")
    return param, rises


def _logit(v: float) -> float:
    lim = 1 / (1 + math.exp(LOGIT_LIMIT))
    v = min(max(v, lim), 1 - lim)
    return math.log(v / (1 - v))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def search(measure: Callable[[float], Probe], start: float, rises: bool, s: SearchSettings,
           log: Callable[[str], None] = lambda m: None, name: str = "threshold") -> tuple[Probe, list[Probe]]:
    """Bracketing search in logit space for the value whose measured share is within s.tolerance of
    the target: first steps from `start` (doubling) until the target is bracketed, then narrows the
    bracket (interpolation, with bisection whenever it stalls). `measure(value)` runs the group at
    `value`. Returns the probe closest to the target and every probe in order."""
    # u: the search coordinate, oriented so that the share rises with it
    sign = 1.0 if rises else -1.0
    probes: list[Probe] = []

    def probe(u: float) -> Probe:
        p = measure(_sigmoid(sign * u))
        probes.append(p)
        log(f"calibrate: probe {len(probes)}/{s.max_iterations}: {name} {p.value:.6g} (logit {sign * u:+.3f}) -> "
            f"large share {p.share:.3f} of {p.tokens} tokens (target {s.target_share:g} +- {s.tolerance:g}, "
            f"{p.seconds:.1f} s)")
        return p

    def done(p: Probe) -> bool:
        return abs(p.share - s.target_share) <= s.tolerance

    u = sign * _logit(start)
    p = probe(u)
    lo = hi = None  # (u, probe) with share below / above the target
    if p.share < s.target_share:
        lo = (u, p)
    else:
        hi = (u, p)
    step = s.step
    # bracket: walk towards the target's side, doubling the step, until the share crosses the target
    while not done(p) and (lo is None or hi is None) and len(probes) < s.max_iterations:
        going_up = hi is None
        if (going_up and u >= LOGIT_LIMIT) or (not going_up and u <= -LOGIT_LIMIT):
            break  # the share does not reach the target within the thresholds' range
        u = min(u + step, LOGIT_LIMIT) if going_up else max(u - step, -LOGIT_LIMIT)
        step *= 2
        p = probe(u)
        if p.share < s.target_share:
            lo = (u, p)
        else:
            hi = (u, p)
    # narrow the honest bracket: each end keeps a measured share on its side of the target. The next
    # probe interpolates the two ends' shares linearly in logit space (a smooth share is found in a
    # few probes); after a probe that did not halve the bracket (a jump, noise) the next one bisects,
    # so the bracket at least halves every two probes.
    interpolate = True
    while (not done(p) and lo is not None and hi is not None and len(probes) < s.max_iterations
           and abs(hi[0] - lo[0]) > LOGIT_RESOLUTION):
        width = abs(hi[0] - lo[0])
        frac = 0.5
        if interpolate:
            frac = (s.target_share - lo[1].share) / (hi[1].share - lo[1].share)
            frac = min(max(frac, 0.05), 0.95)
        u = lo[0] + frac * (hi[0] - lo[0])
        p = probe(u)
        if p.share < s.target_share:
            lo = (u, p)
        else:
            hi = (u, p)
        interpolate = not interpolate or abs(hi[0] - lo[0]) <= width / 2
    best = min(probes, key=lambda q: abs(q.share - s.target_share))
    if not done(best) and lo is not None and hi is not None:
        log(f"calibrate: the share jumps from {lo[1].share:.3f} at {name} {lo[1].value:.6g} to {hi[1].share:.3f} at "
            f"{hi[1].value:.6g} with nothing measured in between")
    return best, probes


def large_share(token_models: Sequence[Sequence[str]], entry_model: str) -> tuple[float, int]:
    """Share of the output tokens written by any model but the entry model, and the token count."""
    total = sum(len(ms) for ms in token_models)
    other = sum(m != entry_model for ms in token_models for m in ms)
    return (other / total if total else 0.0), total


def calibrate_group(group: GroupConfig, prompts: list[list[int]], s: SearchSettings,
                    start: float | None = None, log: Callable[[str], None] = lambda m: None,
                    progress: bool = False) -> OnPolicyCalibration:
    """Run `group` on `prompts` (token ids) through the real runtime and search its algorithm's share
    knob for s.target_share. `start`: the first value probed (default: the group's own value)."""
    from tokenrouter.routed_llm import RoutedLLM

    if not prompts:
        raise ValueError("calibrate: no prompts")
    from tqdm import tqdm

    param, rises = knob(group.algorithm)
    params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens)
    # the bar counts probes against the most the search may run: its ETA is an upper bound
    with RoutedLLM(group) as llm, tqdm(total=s.max_iterations, desc=f"calibrate {group.algorithm}", unit="probe",
                                       disable=not progress) as bar:
        algo = llm.entry.algorithm
        first = float(algo.request_defaults()[param] if start is None else start)

        def measure(value: float) -> Probe:
            t0 = time.monotonic()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False,
                                routing={param: value})
            share, tokens = large_share([o.outputs[0].token_models or [] for o in outs], algo.entry_model)
            bar.update(1)
            bar.set_postfix(share=f"{share:.3f}")
            return Probe(value, share, tokens, time.monotonic() - t0)

        best, probes = search(measure, first, rises, s, log, param)
    return OnPolicyCalibration(group.algorithm, param, s.target_share, s.tolerance, best.value, best.share,
                               abs(best.share - s.target_share) <= s.tolerance, probes)
