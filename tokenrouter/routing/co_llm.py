"""Co-LLM: a deferral head on the small model's last hidden state gives P(defer) = sigmoid(z); above
eta (paper: 0.15) the large model writes that one position."""

from __future__ import annotations

import torch

from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.routing.algorithm import unit_interval
from tokenrouter.routing.deferral import HeadDeferral


class CoLLM(HeadDeferral):
    name = "co_llm"
    request_params = ("eta",)
    share_knob = ("eta", False)
    score_name = "deferral probability"

    def __init__(self, models: list[str], router: str, eta: float | None = None) -> None:
        super().__init__(models, router)
        self.eta = float(eta) if eta is not None else 0.15
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"co_llm: eta must be in [0, 1], got {eta}")

    @classmethod
    def check_request_value(cls, field: str, value: object) -> float:
        return unit_interval(field, value)

    def outputs(self, model: str) -> StepOutputSpec:
        return StepOutputSpec(hidden=model == self.small)

    @torch.inference_mode()
    def scores(self, step: StepOutput) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.router is not None and step.hidden is not None
        p_defer = torch.sigmoid(self.router.head(step.hidden))
        return p_defer, self.request_values(step, "eta", p_defer.device)

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return score > threshold

    def defer(self, step: StepOutput) -> torch.Tensor:
        return self.defers(*self.scores(step))
