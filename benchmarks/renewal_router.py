"""A synthetic router with a chosen run-length distribution (benchmarks/send_patterns.py).

`renewal` hands a request to the large model after a run of k small-model steps, k drawn from a
histogram each time the request arrives on the small model (at its start, or back from the large
model), per (request seed, position) so runs are reproducible; the large model writes one token and
hands back, as bernoulli does. With a bursty histogram (e.g. "1:1,19:1": half the runs end at once,
half after 19 steps, mean 10 as bernoulli at p = 0.1) it is the send pattern the throughput chain
does not assume: a renewal process, not memoryless. The router heads of the default pair
(CITER, R2R, Co-LLM) need hidden states, which the latency-model executor does not compute; this
stands in for them on the paper profile's synthetic pair.

Served as `algorithm: {name: "benchmarks/renewal_router.py:Renewal", runs: "1:1,19:1"}`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tokenrouter.engine.draws import uniform
from tokenrouter.engine.model_runner import StepOutput
from tokenrouter.engine.req import Req
from tokenrouter.routing.deferral import DeferToLarge

_STREAM = 0x2E4E_3A1


class Renewal(DeferToLarge):
    name = "renewal"

    def __init__(self, models: list[str], runs: str = "1:1,19:1", **params: Any) -> None:
        super().__init__(models, **params)
        items = [tuple(float(x) for x in t.split(":")) for t in runs.split(",") if t.strip()]
        ks = np.array([k for k, _ in items])
        ws = np.array([w for _, w in items])
        if len(ks) == 0 or (ks < 1).any() or (ks != np.round(ks)).any() or (ws < 0).any() or ws.sum() <= 0:
            raise ValueError(f"renewal: runs must be 'k:weight,...' with integer k >= 1, got {runs!r}")
        self.ks = ks.astype(np.int64)
        self.cum = np.cumsum(ws / ws.sum())
        self.cum[-1] = 1.0
        self.left: dict[str, int] = {}  # rid -> small-model steps left in its run (small model only)

    def on_finish(self, req: Req) -> None:
        self.left.pop(req.rid, None)

    def defer(self, step: StepOutput) -> torch.Tensor:
        reqs = step.reqs
        new = [r for r in reqs if r.rid not in self.left]
        if new:
            u = uniform([r.seed for r in new], [len(r.tokens) for r in new], _STREAM).numpy()
            for r, k in zip(new, self.ks[np.searchsorted(self.cum, u, side="right").clip(max=len(self.ks) - 1)]):
                self.left[r.rid] = int(k)
        out = []
        for r in reqs:
            self.left[r.rid] -= 1
            if self.left[r.rid] <= 0:
                del self.left[r.rid]  # the next arrival on the small model draws a new run
                out.append(True)
            else:
                out.append(False)
        return torch.tensor(out, dtype=torch.bool)
