"""CITER: an MLP over the small model's last hidden state gives a confidence that the small token
is fine; below tau (paper: 0.98) the large model rewrites that one position."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenrouter.model_runner import StepOutput, StepOutputSpec
from tokenrouter.routing.deferral import DeferToLarge
from tokenrouter.routing.routers import LoadedRouter, check_engine, load_router, router_meta

if TYPE_CHECKING:
    from tokenrouter.engine import Engine


class Citer(DeferToLarge):
    name = "citer"

    def __init__(self, models: list[str], router: str, tau: float | None = None) -> None:
        super().__init__(models)
        router_meta(router, "citer")  # fail fast on a missing or wrong router folder
        self.router_path = router
        self.tau = float(tau) if tau is not None else 0.98
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"citer: tau must be in [0, 1], got {tau}")
        self.router: LoadedRouter | None = None

    def outputs(self, model: str) -> StepOutputSpec:
        return StepOutputSpec(hidden=model == self.small)

    def bind(self, model: str, engine: Engine) -> None:
        # Both models: the router was trained on this pair's hidden states and tokens.
        check_engine(self.router_path, "citer", "small" if model == self.small else "large", engine)
        if model == self.small:
            self.router = load_router(self.router_path, "citer")

    @torch.inference_mode()
    def defer(self, step: StepOutput) -> torch.Tensor:
        assert self.router is not None and step.hidden is not None
        confidence = torch.sigmoid(self.router.head(step.hidden))
        return confidence < self.tau
