"""Two-model deferral: after each small-model token a per-request decision may hand the position to
the large model, which drops the small token, writes exactly one token and hands back.

CITER, R2R, Co-LLM and the synthetic Bernoulli router differ only in `defer`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from tokenrouter.model_runner import StepOutput
from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm


class DeferToLarge(RoutingAlgorithm):
    def __init__(self, models: list[str], **params: Any) -> None:
        super().__init__(models, **params)
        if len(models) != 2:
            raise ValueError(f"{self.name} routes between exactly 2 models (small, large), got {len(models)}")
        self.small, self.large = models

    @abstractmethod
    def defer(self, step: StepOutput) -> torch.Tensor:
        """A bool per sampled request of a small-model step: True hands the position to the large model."""

    def route(self, model: str, step: StepOutput) -> list[Route]:
        if model == self.large:
            return [Route(self.small, keep=True)] * len(step.reqs)
        if not step.reqs:
            return []
        go = Route(self.large, keep=False)
        return [go if d else STAY for d in self.defer(step).tolist()]
