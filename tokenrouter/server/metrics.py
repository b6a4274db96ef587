"""Prometheus metrics of the server: request and token counters kept here, plus per-model engine
figures (KV use, queues, step latency histograms) read from the subservers at scrape time."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tokenrouter.runtime.messages import STEP_LATENCY_BUCKETS, Stats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector(Collector):
    """Exposes the latest Stats of every subserver."""

    def __init__(self) -> None:
        self.stats: dict[str, Stats] = {}

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        gauges = {
            "kv_pages_total": ("KV pool pages", lambda s: s.total_pages),
            "kv_pages_free": ("KV pool pages free", lambda s: s.free_pages),
            "kv_pages_cached": ("KV pool pages held by the prefix cache", lambda s: s.cached_pages),
            "kv_usage_ratio": ("Share of KV pages in use by requests",
                               lambda s: (s.total_pages - s.free_pages - s.cached_pages) / max(1, s.total_pages)),
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
        hist = HistogramMetricFamily("tokenrouter_step_latency_seconds", "Forward step latency per model",
                                     labels=["model"])
        for model, st in self.stats.items():
            cumulative = list(itertools.accumulate(st.step_buckets))
            bounds = [str(b) for b in STEP_LATENCY_BUCKETS] + ["+Inf"]
            hist.add_metric([model], list(zip(bounds, [float(c) for c in cumulative])), st.step_seconds_sum)
        yield hist


class ServerMetrics:
    def __init__(self) -> None:
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
        self.engine = _EngineCollector()
        r.register(self.engine)

    def finished(self, reason: str, prompt_tokens: int, tokens_per_model: dict[str, int], handoffs: int) -> None:
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        for model, n in tokens_per_model.items():
            self.tokens.labels(model).inc(n)
        self.handoffs.inc(handoffs)

    def render(self, stats: dict[str, Stats], waiting: int, running: int) -> bytes:
        self.engine.stats = stats
        self.waiting.set(waiting)
        self.running.set(running)
        return generate_latest(self.registry)
