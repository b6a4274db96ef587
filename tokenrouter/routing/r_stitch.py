"""R-Stitch: normalised entropy H / log(V) of the current model's distribution, both ways. On the
small model H >= tau sends the position to the large model (the small token is dropped); on the
large model H < tau hands control back (its confident token kept), so the large model writes spans.
Training-free; paper tau = 0.03."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm, Scores, unit_interval, unit_param

if TYPE_CHECKING:
    from tokenrouter.engine.engine import Engine


class RStitch(RoutingAlgorithm):
    name = "r_stitch"
    request_params = ("tau",)
    share_knob = ("tau", False)
    score_name = "normalised entropy"

    def __init__(self, models: list[str], tau: float = 0.03) -> None:
        super().__init__(models)
        if len(models) != 2:
            raise ValueError(f"r_stitch routes between exactly 2 models (small, large), got {len(models)}")
        self.tau = unit_param(self.name, "tau", tau)
        self.small, self.large = models
        self.log_vocab: dict[str, float] = {}

    @classmethod
    def check_request_value(cls, field: str, value: object) -> float:
        return unit_interval(field, value)

    def outputs(self, model: str) -> StepOutputSpec:
        return StepOutputSpec(entropy=True)

    def bind(self, model: str, engine: Engine) -> None:
        self.log_vocab[model] = math.log(engine.model_config.vocab_size)

    def normalised_entropy(self, model: str, step: StepOutput) -> torch.Tensor:
        assert step.entropy is not None
        return step.entropy / self.log_vocab[model]

    def route(self, model: str, step: StepOutput) -> list[Route]:
        return self._decide(model, step)[0]

    def route_traced(self, model: str, step: StepOutput) -> tuple[list[Route], Scores | None]:
        routes, h, tau = self._decide(model, step)
        return routes, Scores(h.tolist(), tau.tolist())

    def _decide(self, model: str, step: StepOutput) -> tuple[list[Route], torch.Tensor, torch.Tensor]:
        h = self.normalised_entropy(model, step)
        tau = self.request_values(step, "tau", h.device)
        if model == self.small:
            up = Route(self.large, keep=False)
            return [up if x else STAY for x in (h >= tau).tolist()], h, tau
        down = Route(self.small, keep=True)
        return [down if x else STAY for x in (h < tau).tolist()], h, tau
