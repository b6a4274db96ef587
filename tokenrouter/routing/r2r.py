"""R2R: a residual MLP over the small model's last hidden state, the sampled token's embedding and
its top-k logits scores each token; at or above the threshold (calibrated for about 95% recall of
divergent tokens, stored with the router) the large model rewrites that one position."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.routing.deferral import HeadDeferral
from tokenrouter.routing.routers import RouterScorer

if TYPE_CHECKING:
    from tokenrouter.engine.engine import Engine


class R2R(HeadDeferral):
    name = "r2r"
    request_params = ("threshold",)
    share_knob = ("threshold", False)
    score_name = "divergence probability"

    def __init__(self, models: list[str], router: str, threshold: float | None = None) -> None:
        super().__init__(models, router)
        self.top_k = int(self.meta["arch"]["top_k"])
        self.threshold = self.served_knob(threshold)
        self.scorer: RouterScorer | None = None

    def outputs(self, model: str) -> StepOutputSpec:
        if model == self.small:
            # the router reads the top-k values as features: the screen's ranking moves its score by
            # under 1e-5 (ScreenedHead.top) and saves recomputing the head
            return StepOutputSpec(hidden=True, top_logits=self.top_k, top_exact=False)
        return StepOutputSpec()

    def bind(self, model: str, engine: Engine) -> None:
        super().bind(model, engine)
        if model == self.small:
            want, size = int(self.meta["arch"]["hidden_size"]), engine.model_config.hidden_size
            if want != size:
                raise ValueError(f"r2r router {self.router_path} reads hidden states of size {want}; "
                                 f"small model {engine.cfg.model_path} has hidden size {size}")
            # the small model's own embedding, frozen (whole, even under TP)
            self.scorer = self.router.head.scorer(engine.embedding_weight())

    @torch.inference_mode()
    def scores(self, step: StepOutput) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.scorer is not None
        assert step.hidden is not None and step.top_logits is not None
        tokens = torch.tensor(step.token_ids, device=step.hidden.device)
        score = torch.sigmoid(self.scorer(step.hidden, tokens, step.top_logits[0]))
        return score, self.request_values(step, "threshold", score.device)

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return score >= threshold
