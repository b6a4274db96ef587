"""ME, the multi-model ensemble: at every position the writer is drawn from weights w (paper: 0.5,
0.3, 0.2 over three models), per request and position, so with sampling the token distribution is
exactly the weighted mixture without running every model at every step. No rewrite: the current
token stands and the next writer continues after it."""

from __future__ import annotations

from typing import Any

import torch

from tokenrouter.engine.draws import uniform
from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm

_STREAM = 0xE45E_3B1E
PAPER_WEIGHTS = (0.5, 0.3, 0.2)


class Ensemble(RoutingAlgorithm):
    name = "ensemble"

    def __init__(self, models: list[str], weights: list[float] | None = None, **params: Any) -> None:
        super().__init__(models, **params)
        if len(models) < 2:
            raise ValueError(f"ensemble needs at least 2 models, got {len(models)}")
        if weights is None:
            weights = list(PAPER_WEIGHTS) if len(models) == 3 else [1.0] * len(models)
        if len(weights) != len(models) or any(not float(w) > 0 for w in weights):
            raise ValueError(f"ensemble: one positive weight per model needed, got {weights} for {models}")
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self._cum = torch.tensor(self.weights, dtype=torch.float64).cumsum(0)
        self._cum[-1] = 1.0

    def writers(self, seeds: list[int], positions: list[int]) -> list[int]:
        """The index of the model that writes each (request, position)."""
        u = uniform(seeds, positions, _STREAM)
        return torch.searchsorted(self._cum, u, right=True).clamp_(max=len(self.models) - 1).tolist()

    def route(self, model: str, step: StepOutput) -> list[Route]:
        me = self.models.index(model)
        seeds = [r.seed for r in step.reqs]
        pos = [len(r.tokens) for r in step.reqs]  # the position this step's token would take
        now = self.writers(seeds, pos)
        nxt = self.writers(seeds, [p + 1 for p in pos])
        out = []
        for w_now, w_next in zip(now, nxt):
            if w_now != me:  # only the entry model's first token: another model writes position 0
                out.append(Route(self.models[w_now], keep=False))
            elif w_next != me:
                out.append(Route(self.models[w_next], keep=True))
            else:
                out.append(STAY)
        return out
