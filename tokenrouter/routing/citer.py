"""CITER: an MLP over the small model's last hidden state gives a confidence that the small token
is fine; below tau (paper: 0.98) the large model rewrites that one position."""

from __future__ import annotations

import torch

from tokenrouter.routing.algorithm import unit_param
from tokenrouter.routing.deferral import HiddenStateHead


class Citer(HiddenStateHead):
    name = "citer"
    request_params = ("tau",)
    share_knob = ("tau", True)
    score_name = "confidence"

    def __init__(self, models: list[str], router: str, tau: float = 0.98) -> None:
        super().__init__(models, router)
        self.tau = unit_param(self.name, "tau", tau)

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return score < threshold
