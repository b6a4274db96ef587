"""What the serving runtime adds to the profile's step latencies, for the throughput model.

A profile gives each model's step latency at one token per request. The runtime adds, measured on
the latency-model executor (benchmarks/ablation.py --calibrate, read with tokenrouter/bench/trace_reader.py):

- catch-up tokens: a request handed to L brings the tokens S wrote since L last ran it, which L
  must feed before it samples; with geometric gaps that is (1 - p) / p tokens beyond one per
  request (only for the first token of a span: continuations bring none), each costing the
  profile's per-token latency; `catchup` replaces it with a measured mean (runs cut by a
  request's end never reach L, so the runs that do are shorter than the fitted 1 / p says). S gets
  back a span of L's tokens, m_L - 1 beyond one, for the share p of its batch that just returned.
- a per-step overhead of each model (scheduling, routing, sending tokens and hand-offs, draining
  the inbox): time between two steps of a model that has work;
- the hand-off latency: from the end of the S step that hands a request off to the start of the L
  step that runs it, when L was idle (message, wake-up, scheduling).

The overheads go into the step latencies the chain sees; the hand-off latency and the timing of
returns are the continuous-time chain's (tokenrouter.planner.continuous).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenrouter.planner.latency import Function, LatencyLike, LatencyModel, as_latency


@dataclass(frozen=True)
class Overheads:
    s_token: float = 0.0  # seconds per token beyond one per request, S (the profile's per_token)
    l_token: float = 0.0  # the same for L
    s_overhead: float = 0.0  # seconds per S step added by the runtime
    l_overhead: float = 0.0  # seconds per L step added by the runtime (returns reach S after it)
    handoff: float = 0.0  # seconds from an S step's end to the start of the idle L's step
    # Tokens beyond one a request brings to L per visit. None: the geometric (1 - q_L)(1 - p) / p.
    # Requests that end (EOS, max_tokens) cut their last run without a send, so when long runs end
    # that way the runs that do reach L are shorter than 1 / p: a measured mean is then the figure.
    catchup: float | None = None

    def __post_init__(self) -> None:
        for name in ("s_token", "l_token", "s_overhead", "l_overhead", "handoff"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"runtime {name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.catchup is not None and not self.catchup >= 0.0:
            raise ValueError(f"runtime catchup must be >= 0 tokens, got {self.catchup}")

    def step_latencies(self, lat_s: LatencyLike, lat_l: LatencyLike, p: float, q_l: float = 0.0,
                       riding: float = 0.0) -> tuple[LatencyModel, LatencyModel]:
        """(t_S(b), t_L(b)) as the runtime sees them: profile latency + catch-up tokens + overhead.
        `riding`: look-ahead rows per queued visit of L (docs/DESIGN.md section 3), run as rows of
        L's batch: the visit's own last token, run ahead, so its catch-up is a token less, and the
        rows behind the returns L answered without a step."""
        s, lat = as_latency(lat_s), as_latency(lat_l)
        geometric = (1.0 - q_l) * (1.0 - p) / p if p > 0 else 0.0
        l_extra = geometric if self.catchup is None else self.catchup
        if riding > 0:
            l_extra = max(l_extra - 1.0, 0.0)
        s_extra = p * q_l / (1.0 - q_l)
        s_eff = Function(lambda b: s(b) + self.s_overhead + self.s_token * s_extra * b)
        l_eff = Function(lambda b: lat(b + riding * b) + self.l_overhead + self.l_token * l_extra * b)
        return s_eff, l_eff
