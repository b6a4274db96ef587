"""A budgeted deferral: the small model writes; where it is unsure (normalised entropy >= tau) the
large model rewrites that position, but never more than a share `budget` of a request's tokens.

A routing algorithm in its own file, served with
`tokenrouter serve --config examples/budgeted_pair.yaml` (docs/ALGORITHMS.md walks through it).
Both parameters may also be set per request: {"routing": {"budget": 0.1}} in an OpenAI request.
"""

from __future__ import annotations

import math
from typing import Any

from tokenrouter.engine.model_runner import StepOutput, StepOutputSpec
from tokenrouter.engine.req import Req
from tokenrouter.routing import STAY, Route, RoutingAlgorithm, unit_interval


class BudgetedDeferral(RoutingAlgorithm):
    name = "budgeted_deferral"
    request_params = ("budget", "tau")  # a request may set these for itself

    def __init__(self, models: list[str], budget: float = 0.2, tau: float = 0.5) -> None:
        super().__init__(models)
        if len(models) != 2:
            raise ValueError(f"{self.name} routes between exactly 2 models (small, large), got {models}")
        self.small, self.large = models
        self.budget = unit_interval("budget", budget)  # the group's values are the requests' defaults
        self.tau = unit_interval("tau", tau)
        self.log_vocab = 1.0
        self.large_tokens: dict[str, int] = {}  # rid -> positions the large model wrote (per-request state)

    @classmethod
    def check_request_value(cls, field: str, value: Any) -> float:
        return unit_interval(field, value)  # both are shares in [0, 1]; the error names the field

    def outputs(self, model: str) -> StepOutputSpec:
        return StepOutputSpec(entropy=model == self.small)

    def bind(self, model: str, engine: Any) -> None:
        self.log_vocab = math.log(engine.model_config.vocab_size)

    def on_start(self, req: Req) -> None:
        self.large_tokens[req.rid] = 0

    def on_finish(self, req: Req) -> None:
        del self.large_tokens[req.rid]

    def route(self, model: str, step: StepOutput) -> list[Route]:
        if model == self.large:  # the large model wrote its one position: back to the small one
            return [Route(self.small, keep=True)] * len(step.reqs)
        if not step.reqs:
            return []
        assert step.entropy is not None
        unsure = (step.entropy / self.log_vocab >= self.request_values(step, "tau", step.entropy.device)).tolist()
        budgets = self.request_values(step, "budget").tolist()
        routes = []
        for req, u, budget in zip(step.reqs, unsure, budgets):
            spent = self.large_tokens[req.rid]
            # The position about to be written is output token num_output; the large model may write it
            # if its share of the first num_output + 1 tokens stays within the budget.
            if u and spent + 1 <= budget * (req.num_output + 1):
                self.large_tokens[req.rid] = spent + 1
                routes.append(Route(self.large, keep=False))  # drop the small token; the large rewrites it
            else:
                routes.append(STAY)
        return routes
