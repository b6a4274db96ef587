"""CITER: an MLP over the small model's last hidden state gives a confidence that the small token
is fine; below tau (paper: 0.98) the large model rewrites that one position."""

from __future__ import annotations

import torch

from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.routing.algorithm import unit_interval
from tokenrouter.routing.deferral import HeadDeferral


class Citer(HeadDeferral):
    name = "citer"
    request_params = ("tau",)
    share_knob = ("tau", True)
    score_name = "confidence"

    def __init__(self, models: list[str], router: str, tau: float | None = None) -> None:
        super().__init__(models, router)
        self.tau = float(tau) if tau is not None else 0.98
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"citer: tau must be in [0, 1], got {tau}")

    @classmethod
    def check_request_value(cls, field: str, value: object) -> float:
        return unit_interval(field, value)

    def outputs(self, model: str) -> StepOutputSpec:
        return StepOutputSpec(hidden=model == self.small)

    @torch.inference_mode()
    def scores(self, step: StepOutput) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.router is not None and step.hidden is not None
        confidence = torch.sigmoid(self.router.head(step.hidden))
        return confidence, self.request_values(step, "tau", confidence.device)

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return score < threshold

    def defer(self, step: StepOutput) -> torch.Tensor:
        return self.defers(*self.scores(step))
