"""Run lengths between sends, measured, against the chain's geometric assumption.

A run is the number of consecutive steps one model makes on a request before it hands the request
to another model: k >= 1 steps, the last of which is dropped (the other model rewrites that
position), so the request keeps g = k - 1 of the run's tokens (the simulator's "gap"). The chain of
tokenrouter.planner.chain assumes every step sends with the same probability p, independently:
k ~ Geometric(p) on 1, 2, ....

Runs read off a trace are censored: a request that finishes in the middle of a run never shows
where that run would have ended. Everything here treats a censored run of k steps as k - 1 steps
without a send (its last step's decision is not observed), through the discrete hazard:

    n_j = runs still running at step j, d_j = runs that sent at step j, h_j = d_j / n_j.

Under the geometric assumption every h_j is p. The fit is the maximum-likelihood p = sum d / sum n;
the goodness of fit is a chi-square over bins of steps, X^2 = sum_b (D_b - p N_b)^2 / (p (1 - p) N_b)
with D_b, N_b the sums of d_j, n_j over the bin (a sum of conditionally independent Bernoulli
decisions, so X^2 is chi-square with bins - 1 degrees of freedom under the assumption); and the
largest distance between the Kaplan-Meier survival prod (1 - h_i) and the geometric (1 - p)^j.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2

__all__ = ["GapFit", "fit_runs", "hazard"]


def hazard(sent: Sequence[int], cut: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(n_j, d_j) for j = 1..max run: runs at risk at step j and runs that sent at step j."""
    s = np.asarray(sent, dtype=np.int64)
    c = np.asarray(cut, dtype=np.int64)
    if (s < 1).any() or (c < 1).any():
        raise ValueError("run lengths are >= 1 step")
    if len(s) == 0:
        raise ValueError("no run ended in a send: nothing to fit")
    top = int(max(s.max(), c.max() if len(c) else 0))
    d = np.bincount(s, minlength=top + 1)[1:]
    # a sent run of k is at risk at 1..k; a censored run of k at 1..k - 1
    ends = np.bincount(s, minlength=top + 2)[1:] + np.bincount(np.maximum(c - 1, 0), minlength=top + 2)[1:]
    n = ends[::-1].cumsum()[::-1][:top]
    return n.astype(float), d.astype(float)


@dataclass
class GapFit:
    """A run-length sample against the geometric run length with the same hazard."""

    p: float  # maximum-likelihood send probability per step (geometric fit, censoring included)
    runs: int  # runs that ended in a send
    censored: int  # runs cut by the request's end
    mean_steps: float  # mean run length, Kaplan-Meier (censoring corrected, tail beyond the data at the last step)
    cv: float  # coefficient of variation of the run length (Kaplan-Meier); geometric: sqrt(1 - p)
    chi2: float  # X^2 of the hazard bins
    dof: int
    p_value: float  # of X^2 under the geometric assumption
    ks: float  # max_j |S_KM(j) - (1 - p)^j|
    steps: np.ndarray  # j = 1..max
    survival: np.ndarray  # Kaplan-Meier P(run > j)
    pmf: np.ndarray  # Kaplan-Meier P(run = j) (what is left beyond the last step is put on it)

    def gap_histogram(self) -> dict[int, float]:
        """{gap tokens kept (k - 1): probability}: the measured distribution as the simulator takes it."""
        return {int(k) - 1: float(w) for k, w in zip(self.steps, self.pmf) if w > 0}

    def to_json(self) -> dict:
        return {"p": self.p, "runs": self.runs, "censored": self.censored, "mean_steps": self.mean_steps,
                "cv": self.cv, "geometric_cv": float(np.sqrt(1.0 - self.p)), "chi2": self.chi2, "dof": self.dof,
                "p_value": self.p_value, "ks": self.ks}


def _bins(expected: np.ndarray, min_expected: float) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) bins of steps, each with at least `min_expected` expected sends (the last
    bin takes the remainder)."""
    bins, lo, acc = [], 0, 0.0
    for j, e in enumerate(expected):
        acc += e
        if acc >= min_expected:
            bins.append((lo, j + 1))
            lo, acc = j + 1, 0.0
    if lo < len(expected):
        if bins:
            bins[-1] = (bins[-1][0], len(expected))
        else:
            bins.append((0, len(expected)))
    return bins


def fit_runs(sent: Sequence[int], cut: Sequence[int] = (), min_expected: float = 5.0) -> GapFit:
    """Fit the geometric run length to runs that sent (`sent`) and censored ones (`cut`), and test it."""
    n, d = hazard(sent, cut)
    p = float(d.sum() / n.sum())
    h = np.divide(d, n, out=np.zeros_like(d), where=n > 0)
    surv = np.cumprod(1.0 - h)
    steps = np.arange(1, len(n) + 1)
    pmf = np.concatenate([[1.0], surv[:-1]]) - surv
    pmf[-1] += surv[-1]  # the tail the data does not see
    mean = float(steps @ pmf)
    var = float((steps - mean) ** 2 @ pmf)
    bins = _bins(n * p, min_expected)
    if 0.0 < p < 1.0 and len(bins) > 1:
        x2 = float(sum((d[a:b].sum() - p * n[a:b].sum()) ** 2 / (p * (1.0 - p) * n[a:b].sum()) for a, b in bins))
        dof = len(bins) - 1
        pv = float(chi2.sf(x2, dof))
    else:
        x2, dof, pv = 0.0, 0, 1.0
    ks = float(np.abs(surv - (1.0 - p) ** steps).max())
    return GapFit(p=p, runs=int(d.sum()), censored=len(cut), mean_steps=mean, cv=float(np.sqrt(var)) / mean,
                  chi2=x2, dof=dof, p_value=pv, ks=ks, steps=steps, survival=surv, pmf=pmf)
