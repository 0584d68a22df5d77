"""Prometheus metrics of one API server, with vLLM's metric names, in a private registry.

Request-level metrics (latencies, token counters, successes) are observed in the API
process; engine-level ones (queue sizes, KV usage, prefix-cache counters, preemptions) are
read from the latest ``EngineStats`` at scrape time by a collector.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_core.messages import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineStatsCollector(Collector):
    """Yields engine gauges and counters from the stats snapshot held by ``ServerMetrics``."""

    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        stats, labels = self._owner.engine_stats, [self._owner.model_name]
        if stats is None:
            return
        gauges = {
            "vllm:num_requests_running": ("Requests in model execution batches.",
                                          stats.num_running),
            "vllm:num_requests_waiting": ("Requests waiting to be processed.",
                                          stats.num_waiting + stats.num_waiting_for_remote_kv),
            "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.",
                                         stats.kv_cache_usage),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family
        counters = {
            "vllm:prefix_cache_queries": ("Prefix cache queries, in tokens.",
                                          stats.prefix_cache_queries),
            "vllm:prefix_cache_hits": ("Prefix cache hits, in tokens.", stats.prefix_cache_hits),
            "vllm:num_preemptions": ("Cumulative number of preemptions.", stats.num_preemptions),
        }
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            yield family


class ServerMetrics:
    """All metrics of one server; ``render()`` gives the Prometheus text."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_stats: EngineStats | None = None
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", labels,
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end-to-end request latency in seconds.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", labels,
                                         registry=self.registry)
        self.request_success = Counter("vllm:request_success",
                                       "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        self.registry.register(_EngineStatsCollector(self))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def observe_finished(self, e2e_seconds: float, finish_reason: str | None,
                         num_prompt_tokens: int, num_output_tokens: int) -> None:
        """One request ended (finished, aborted or failed)."""
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(num_output_tokens)
        if finish_reason in ("stop", "length"):
            self.e2e.labels(self.model_name).observe(e2e_seconds)
            self.request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
