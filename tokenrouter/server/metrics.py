"""Prometheus metrics of the server: request and token counters kept here, plus per-model engine
figures (KV use, queues, step latency histograms) read from the subservers at scrape time, and load
adaptation's gauges (tokenrouter_adaptive_*) when the server adapts.

Each figure exists in our own names (tokenrouter_*) and, where vLLM has one, in vLLM's (vllm:*) so
that vLLM dashboards work unchanged. vLLM's carry a `model_name` label: the served name for the
group as a whole, and each member's name for what that model alone holds or wrote (see
docs/DEPLOYMENT.md for which metric has which)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tokenrouter.runtime.entry.adaptation import AdaptState
from tokenrouter.runtime.messages import STEP_LATENCY_BUCKETS, Stats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# vLLM's buckets for its request histograms, so its dashboards' quantiles read alike.
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
_VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0)


def _kv_used(s: Stats) -> int:
    """Pages held by requests; pages only the prefix cache holds are evictable, so free (as vLLM counts)."""
    return s.total_pages - s.free_pages - s.cached_pages


class _EngineCollector(Collector):
    """Exposes the latest Stats of every subserver."""

    def __init__(self, group_name: str) -> None:
        self.group_name = group_name
        self.stats: dict[str, Stats] = {}
        self.waiting = 0  # at the entry, for admission
        self.running = 0  # admitted at the entry and unfinished

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily | CounterMetricFamily]:
        gauges = {
            "kv_pages_total": ("KV pool pages", lambda s: s.total_pages),
            "kv_pages_free": ("KV pool pages free", lambda s: s.free_pages),
            "kv_pages_cached": ("KV pool pages held by the prefix cache", lambda s: s.cached_pages),
            "kv_usage_ratio": ("Share of KV pages in use by requests", lambda s: _kv_used(s) / max(1, s.total_pages)),
            "model_live_requests": ("Requests a model holds (running, waiting or PENDING)", lambda s: s.live_requests),
            "model_waiting_requests": ("Requests queued in a model's scheduler", lambda s: s.waiting_requests),
            "model_preemptions": ("Preemptions so far", lambda s: s.preemptions),
            "model_pending_seconds": ("Total seconds requests spent PENDING at a peer", lambda s: s.pending_seconds),
        }
        for name, (doc, get) in gauges.items():
            fam = GaugeMetricFamily(f"tokenrouter_{name}", doc, labels=["model"])
            for model, st in self.stats.items():
                fam.add_metric([model], float(get(st)))
            yield fam
        counters = {
            "model_written_tokens": ("Tokens a model committed (aborted and failed requests' too)",
                                     lambda s: s.tokens_written),
            "model_aborted_requests": ("Live requests a model dropped on an abort (client gone, time limit, "
                                       "a peer failed)", lambda s: s.aborted_requests),
            "model_look_ahead_rows": ("Rows a model ran ahead for requests it handed to a peer",
                                      lambda s: s.look_aheads),
            "model_look_ahead_hits": ("Requests that came back to a model whose next token a look-ahead "
                                      "had already sampled (answered without a step)", lambda s: s.look_ahead_hits),
            "model_spec_decode_draft_tokens": ("Draft tokens a model verified for a peer (speculative)",
                                               lambda s: s.drafts_verified),
            "model_spec_decode_accepted_tokens": ("Of those, the ones its own samples agreed with",
                                                  lambda s: s.drafts_accepted),
            "model_threaded_steps": ("Steps a model ran on more than one thread (core sharing: a small step "
                                     "while no peer steps)", lambda s: s.threaded_steps),
        }
        for name, (doc, get) in counters.items():
            counter = CounterMetricFamily(f"tokenrouter_{name}", doc, labels=["model"])
            for model, st in self.stats.items():
                counter.add_metric([model], float(get(st)))
            yield counter
        errors = CounterMetricFamily("tokenrouter_model_request_errors",
                                     "Requests a model failed alone, by the stage that raised (step, commit, "
                                     "route, send, receive, on_start, on_finish)", labels=["model", "stage"])
        for model, st in self.stats.items():
            for stage, n in sorted(st.request_errors.items()):
                errors.add_metric([model, stage], float(n))
        yield errors
        hist = HistogramMetricFamily("tokenrouter_step_latency_seconds", "Forward step latency per model",
                                     labels=["model"])
        for model, st in self.stats.items():
            cumulative = list(itertools.accumulate(st.step_buckets))
            bounds = [str(b) for b in STEP_LATENCY_BUCKETS] + ["+Inf"]
            hist.add_metric([model], list(zip(bounds, [float(c) for c in cumulative])), st.step_seconds_sum)
        yield hist
        yield from self._vllm_gauges()

    def _vllm_gauges(self) -> Iterator[GaugeMetricFamily]:
        """vLLM's gauges: one series for the group (its served name) and one per member model."""
        stats = self.stats.values()
        used, total = sum(_kv_used(s) for s in stats), sum(s.total_pages for s in stats)
        gauges = {
            # A member's running requests are those it holds past its queue, PENDING ones included
            # (they keep their KV there while a peer writes).
            "num_requests_running": ("Requests admitted and unfinished", self.running,
                                     lambda s: s.live_requests - s.waiting_requests),
            "num_requests_waiting": ("Requests waiting for admission", self.waiting, lambda s: s.waiting_requests),
            "kv_cache_usage_perc": ("KV-cache usage; 1 means 100 percent", used / max(1, total),
                                    lambda s: _kv_used(s) / max(1, s.total_pages)),
        }
        for name, (doc, group_value, get) in gauges.items():
            fam = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            fam.add_metric([self.group_name], float(group_value))
            for model, st in self.stats.items():
                fam.add_metric([model], float(get(st)))
            yield fam


class _AdaptCollector(Collector):
    """Load adaptation's live figures (runtime/entry/adaptation.py), when the server adapts: the share knob's
    value now and its bounds (labelled with the algorithm and the knob's name), the TPOT target, the
    last window's p99 TPOT of adapting requests and each member's share of their tokens."""

    def __init__(self, group_name: str) -> None:
        self.group_name = group_name
        self.state: AdaptState | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.state
        if st is None:
            return
        knob_labels = ["model_name", "algorithm", "param"]
        for name, doc, value in (("knob", "The share knob's value adapting requests start with now", st.value),
                                 ("knob_served", "The share knob's served point (the adaptation's upper bound)",
                                  st.served),
                                 ("knob_floor", "The share knob's floor (the adaptation's lower bound)", st.floor)):
            fam = GaugeMetricFamily(f"tokenrouter_adaptive_{name}", doc, labels=knob_labels)
            fam.add_metric([self.group_name, st.algorithm, st.param], value)
            yield fam
        fam = GaugeMetricFamily("tokenrouter_adaptive_target_tpot_seconds", "The p99 time per output token held",
                                labels=["model_name"])
        fam.add_metric([self.group_name], st.target_s)
        yield fam
        fam = GaugeMetricFamily("tokenrouter_adaptive_tpot_p99_seconds",
                                "p99 time per output token of adapting requests over the last window "
                                "(absent when none streamed)", labels=["model_name"])
        if st.p99_s is not None:
            fam.add_metric([self.group_name], st.p99_s)
        yield fam
        fam = GaugeMetricFamily("tokenrouter_adaptive_token_share",
                                "Each member's share of adapting requests' tokens over the last window",
                                labels=["model_name"])
        for model, share in st.shares.items():
            fam.add_metric([model], share)
        yield fam


class ServerMetrics:
    def __init__(self, group_name: str) -> None:
        self.group_name = group_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tokenrouter_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("tokenrouter_rejected_requests", "Requests answered with an error status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("tokenrouter_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.tokens = Counter("tokenrouter_generated_tokens", "Generated tokens by the model that wrote them",
                              ["model"], registry=r)
        self.handoffs = Counter("tokenrouter_handoffs", "Model switches inside answers", registry=r)
        self.waiting = Gauge("tokenrouter_queue_waiting", "Requests waiting for admission at the entry", registry=r)
        self.running = Gauge("tokenrouter_requests_running", "Requests admitted and unfinished", registry=r)
        self.ttft = Histogram("tokenrouter_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tokenrouter_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # vLLM's names (model_name: the served group; generation tokens also per member that wrote them)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed",
                                          ["model_name"], registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed",
                                              ["model_name"], registry=r)
        self.vllm_success = Counter("vllm:request_success", "Count of successfully processed requests",
                                    ["model_name", "finished_reason"], registry=r)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds",
                                   ["model_name"], buckets=_VLLM_TTFT_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds",
                                  ["model_name"], buckets=_VLLM_ITL_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds",
                                  ["model_name"], buckets=_VLLM_E2E_BUCKETS, registry=r)
        self.engine = _EngineCollector(group_name)
        r.register(self.engine)
        self.adapt = _AdaptCollector(group_name)
        r.register(self.adapt)

    def finished(self, reason: str, prompt_tokens: int, tokens_per_model: dict[str, int], handoffs: int,
                 e2e: float, ttft: float | None, itl: list[float]) -> None:
        """A request ended: its counts and latencies (`itl`: the gaps between its successive tokens)."""
        group = self.group_name
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm_prompt_tokens.labels(group).inc(prompt_tokens)
        for model, n in tokens_per_model.items():
            self.tokens.labels(model).inc(n)
            self.vllm_generation_tokens.labels(model).inc(n)
        self.vllm_generation_tokens.labels(group).inc(sum(tokens_per_model.values()))
        self.handoffs.inc(handoffs)
        if reason in ("stop", "length", "abort"):  # vLLM's finish reasons; errors are no success
            self.vllm_success.labels(group, reason).inc()
        self.e2e.observe(e2e)
        self.vllm_e2e.labels(group).observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            self.vllm_ttft.labels(group).observe(ttft)
        itl_hist = self.vllm_itl.labels(group)
        for gap in itl:
            itl_hist.observe(gap)

    def render(self, stats: dict[str, Stats], waiting: int, running: int, adapt: AdaptState | None = None) -> bytes:
        self.engine.stats = stats
        self.adapt.state = adapt
        self.engine.waiting, self.engine.running = waiting, running
        self.waiting.set(waiting)
        self.running.set(running)
        return generate_latest(self.registry)
