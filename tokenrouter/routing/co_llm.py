"""Co-LLM: a deferral head on the small model's last hidden state gives P(defer) = sigmoid(z); above
eta (paper: 0.15) the large model writes that one position."""

from __future__ import annotations

import torch

from tokenrouter.routing.algorithm import unit_param
from tokenrouter.routing.deferral import HiddenStateHead


class CoLLM(HiddenStateHead):
    name = "co_llm"
    request_params = ("eta",)
    share_knob = ("eta", False)
    score_name = "deferral probability"

    def __init__(self, models: list[str], router: str, eta: float = 0.15) -> None:
        super().__init__(models, router)
        self.eta = unit_param(self.name, "eta", eta)

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return score > threshold
