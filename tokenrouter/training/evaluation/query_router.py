"""A query-level router in the style of RouteLLM: the whole request goes to one model, chosen from
the prompt alone before any token is written.

Features are the small model's final hidden states, mean-pooled over the prompt (the request has to
pass through some model to be routed; the small one is the cheap choice). The label of a training
problem is how much the large model gains over the small one on a reference solution: the difference
of their mean per-token NLLs. A ridge regression predicts that gain; the requests with the highest
predicted gain go to the large model, as many as the chosen share allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tokenrouter.training.evaluation.metrics import nll_under


@torch.no_grad()
def prompt_features(model: Any, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """[n, hidden]: the mean of the last layer's hidden states over each prompt's tokens."""
    rows = []
    for p in prompts:
        out = model(input_ids=torch.tensor([list(p)]), output_hidden_states=True)
        rows.append(out.hidden_states[-1][0].float().mean(0))
    return torch.stack(rows)


def gain_labels(small: Any, large: Any, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]]
                ) -> torch.Tensor:
    """Per problem: mean NLL of the reference under the small model minus under the large model."""
    n = torch.tensor([max(1, len(r)) for r in references], dtype=torch.float64)
    s = torch.tensor(nll_under(small, prompts, references), dtype=torch.float64) / n
    g = torch.tensor(nll_under(large, prompts, references), dtype=torch.float64) / n
    return (s - g).float()


class QueryRouter:
    """Ridge regression from prompt features to the large model's predicted gain."""

    def __init__(self, ridge: float = 1.0) -> None:
        if ridge <= 0:
            raise ValueError(f"ridge must be positive, got {ridge}")
        self.ridge = ridge
        self.mean: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None

    def fit(self, features: torch.Tensor, gains: torch.Tensor) -> QueryRouter:
        if features.shape[0] != gains.shape[0] or features.shape[0] < 2:
            raise ValueError(f"need two or more (features, gain) pairs of equal count, got "
                             f"{features.shape[0]} and {gains.shape[0]}")
        x = features.double()
        self.mean, self.scale = x.mean(0), x.std(0).clamp_min(1e-6)
        z = torch.cat([(x - self.mean) / self.scale, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        reg = self.ridge * torch.eye(z.shape[1], dtype=x.dtype)
        reg[-1, -1] = 0.0  # the intercept is not shrunk
        self.weight = torch.linalg.solve(z.T @ z + reg, z.T @ gains.double())
        return self

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        if self.weight is None or self.mean is None or self.scale is None:
            raise RuntimeError("QueryRouter.fit must run before scores")
        z = (features.double() - self.mean) / self.scale
        return (z @ self.weight[:-1] + self.weight[-1]).float()


def route_top(scores: torch.Tensor, share: float) -> torch.Tensor:
    """A bool mask sending round(share * n) requests, those with the highest scores, to the large model."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    k = round(share * scores.numel())
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[torch.argsort(scores, descending=True, stable=True)[:k]] = True
    return mask
