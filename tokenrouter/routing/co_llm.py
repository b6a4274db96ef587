"""Co-LLM: a deferral head on the small model's last hidden state gives P(defer) = sigmoid(z); above
eta the large model writes that one position. Without eta, the threshold the router was calibrated
with serves (the paper's 0.15 is its own router's)."""

from __future__ import annotations

import torch

from tokenrouter.routing.deferral import HiddenStateHead


class CoLLM(HiddenStateHead):
    name = "co_llm"
    request_params = ("eta",)
    share_knob = ("eta", False)
    score_name = "deferral probability"

    def __init__(self, models: list[str], router: str, eta: float | None = None) -> None:
        super().__init__(models, router)
        self.eta = self.served_knob(eta)

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return score > threshold
