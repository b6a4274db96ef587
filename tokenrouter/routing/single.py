"""`single`: one model writes everything (the baseline, and a group of one)."""

from __future__ import annotations

from typing import Any

from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm


class SingleModel(RoutingAlgorithm):
    name = "single"

    def __init__(self, models: list[str], **params: Any) -> None:
        super().__init__(models, **params)

    def may_visit(self) -> list[str]:
        return [self.entry_model]

    def route(self, model: str, step: StepOutput) -> list[Route]:
        return [STAY] * len(step.reqs)
