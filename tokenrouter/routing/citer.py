"""CITER: an MLP over the small model's last hidden state gives a confidence that the small token
is fine; below tau the large model rewrites that one position. Without tau, the threshold the router
was calibrated with serves (the paper fixes 0.98 for its own router)."""

from __future__ import annotations

import torch

from tokenrouter.routing.deferral import HiddenStateHead


class Citer(HiddenStateHead):
    name = "citer"
    request_params = ("tau",)
    share_knob = ("tau", True)
    score_name = "confidence"

    def __init__(self, models: list[str], router: str, tau: float | None = None) -> None:
        super().__init__(models, router)
        self.tau = self.served_knob(tau)

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return score < threshold
