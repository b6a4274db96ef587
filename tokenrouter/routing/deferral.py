"""Two-model deferral: after each small-model token a per-request decision may hand the position to
the large model, which drops the small token, writes exactly one token and hands back.

CITER, R2R, Co-LLM and the synthetic Bernoulli router differ only in `defer`, and in the score behind
it (`scores` and `defers`), which a traced request reports per token. Their per-request parameters are
numbers in [0, 1] (a probability or a threshold on one).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.routing.algorithm import STAY, Route, RoutingAlgorithm, Scores, unit_interval, unit_param
from tokenrouter.routing.routers import LoadedRouter, check_pair, engine_fingerprint, load_router, router_meta

if TYPE_CHECKING:
    from tokenrouter.engine.engine import Engine


class DeferToLarge(RoutingAlgorithm):
    def __init__(self, models: list[str], **params: Any) -> None:
        super().__init__(models, **params)
        if len(models) != 2:
            raise ValueError(f"{self.name} routes between exactly 2 models (small, large), got {len(models)}")
        self.small, self.large = models

    @classmethod
    def check_request_value(cls, field: str, value: object) -> float:
        return unit_interval(field, value)

    @abstractmethod
    def defer(self, step: StepOutput) -> torch.Tensor:
        """A bool per sampled request of a small-model step: True hands the position to the large model."""

    def scores(self, step: StepOutput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The score of each sampled request of a small-model step and the threshold it is compared
        with (defer is `defers(score, threshold)`); None: this algorithm has no score."""
        return None

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        """defer from scores' numbers: implemented by the algorithms that have a score."""
        raise NotImplementedError

    def looks_ahead(self, model: str) -> bool:
        # The router often defers the position right after the large model's token (hard positions
        # come in clusters: docs/BENCHMARKS.md, the trained routers' run lengths).
        return model == self.large

    def route(self, model: str, step: StepOutput) -> list[Route]:
        if model == self.large:
            return [Route(self.small, keep=True)] * len(step.reqs)
        return self._routes(self.defer(step))

    def route_traced(self, model: str, step: StepOutput) -> tuple[list[Route], Scores | None]:
        scored = self.scores(step) if model == self.small else None
        if scored is None:
            return self.route(model, step), None
        score, threshold = scored
        return self._routes(self.defers(score, threshold)), Scores(score.tolist(), threshold.tolist())

    def _routes(self, defer: torch.Tensor) -> list[Route]:
        go = Route(self.large, keep=False)
        return [go if d else STAY for d in defer.tolist()]


class HeadDeferral(DeferToLarge):
    """Deferral decided by a trained router head: the folder of a router of kind `name` (CITER, R2R,
    Co-LLM). The head runs on the small model's subserver; both models must be the ones it was trained
    for, since it reads this pair's hidden states and tokens."""

    needs_router = True

    def __init__(self, models: list[str], router: str) -> None:
        super().__init__(models)
        self.meta = router_meta(router, self.name)  # fails fast on a missing or wrong router folder
        self.router_path = router
        self.router: LoadedRouter | None = None

    def served_knob(self, given: float | None) -> float:
        """The share knob's value the algorithm serves: the one given, else the threshold the router
        was calibrated with (its router.json), checked to lie in [0, 1]. The one rule for every router
        kind, whether the value comes from a YAML file, the command line or a prepared pair."""
        assert self.share_knob is not None
        return unit_param(self.name, self.share_knob[0], float(self.meta["threshold"]) if given is None else given)

    def bind(self, model: str, engine: Engine) -> None:
        role = "small" if model == self.small else "large"
        check_pair(self.meta, role, engine_fingerprint(engine), engine.cfg.model_path, self.router_path)
        if model == self.small:
            self.router = load_router(self.router_path, self.name)

    def defer(self, step: StepOutput) -> torch.Tensor:
        scored = self.scores(step)
        assert scored is not None, f"{self.name}: a router head always scores"
        return self.defers(*scored)


class HiddenStateHead(HeadDeferral):
    """A head over the small model's last hidden state whose sigmoid is the score, compared with the
    request's `share_knob` parameter (CITER's confidence against tau, Co-LLM's deferral probability
    against eta); a subclass says which way in `defers`."""

    def outputs(self, model: str) -> StepOutputSpec:
        return StepOutputSpec(hidden=model == self.small)

    @torch.inference_mode()
    def scores(self, step: StepOutput) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.router is not None and step.hidden is not None
        score = torch.sigmoid(self.router.head(step.hidden))
        return score, self.request_values(step, self.knob_param(), score.device)
