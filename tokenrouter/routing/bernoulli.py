"""`bernoulli`: the synthetic router. After each token of the first model, hand the position to the
second with probability p, drawn per (request seed, position) so runs are reproducible; the first
model's token is dropped, the second writes exactly one token and hands back (as R2R does).

It separates system speed from router quality, and matches the throughput model's assumption of
geometric gaps between hand-offs.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenrouter.engine.draws import uniform
from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.routing.algorithm import unit_param
from tokenrouter.routing.deferral import DeferToLarge

_STREAM = 0x5EED_B0B  # keeps routing draws independent of sampling draws


def routing_draws(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """The uniform draw (float64) of each (request seed, position): below p, the second model writes it."""
    return uniform(seeds, positions, _STREAM)


def hands_off(seeds: list[int], positions: list[int], p: float | list[float]) -> torch.Tensor:
    """Which positions the second model writes: a pure function of (request seed, position), so the
    standard-serving baseline and the tests make the same draws as the router. `p`: one for all, or
    one per position (compared in float64, so a per-request p draws as the group's does). In numpy:
    this runs on every step of the small model, where each torch operation costs microseconds."""
    u = routing_draws(seeds, positions).numpy()
    return torch.from_numpy(u < np.asarray(p, dtype=np.float64))


class Bernoulli(DeferToLarge):
    name = "bernoulli"
    request_params = ("p",)
    share_knob = ("p", True)
    score_name = "draw"  # the uniform routing draw of the position: below p, the large model writes it

    def __init__(self, models: list[str], p: float = 0.1) -> None:
        super().__init__(models)
        self.p = unit_param(self.name, "p", p)

    def defer(self, step: StepOutput) -> torch.Tensor:
        # The draw is for the position about to be written: len(tokens) before the token is committed.
        params = self.params_of
        return hands_off([r.seed for r in step.reqs], [len(r.tokens) for r in step.reqs],
                         [params[r.rid]["p"] for r in step.reqs])

    def scores(self, step: StepOutput) -> tuple[torch.Tensor, torch.Tensor]:
        u = routing_draws([r.seed for r in step.reqs], [len(r.tokens) for r in step.reqs])
        return u, self.request_values(step, "p", dtype=torch.float64)

    def defers(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return score < threshold  # float64 both, as hands_off compares
