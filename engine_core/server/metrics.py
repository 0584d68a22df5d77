"""Prometheus metrics of one API server, with vLLM's metric names, in a private registry.

Request-level metrics (latencies, successes, per-request token histograms) are observed in
the API process; engine-level ones (queue sizes, KV usage, prefix-cache counters,
preemptions, and the prompt/generation token counters, which move every step as vLLM's do)
are read from the latest ``EngineStats`` at scrape time by a collector.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine_core.messages import ITERATION_TOKEN_BUCKETS, EngineStats

# vLLM V1's labels on every metric: the served model and the engine's index (one engine a
# worker here: "0"), so dashboards filtering or grouping by either work unchanged.
LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# The upper ends vLLM's histograms reach (TTFT 2560 s; whole requests and their phases 7680
# s), so an overloaded queue or a long decode is not flattened at 80 s.
_TTFT_BUCKETS = _LATENCY_BUCKETS + (160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = _LATENCY_BUCKETS + (160.0, 320.0, 640.0, 1280.0, 2560.0, 7680.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)

# pdserve_timings key -> (metric, help); vLLM's names where vLLM has the metric.
_BREAKDOWN_METRICS = {
    "queue_ms": ("vllm:request_queue_time_seconds",
                 "Histogram of time spent in WAITING phase for request."),
    "prefill_ms": ("vllm:request_prefill_time_seconds",
                   "Histogram of time spent in PREFILL phase for request."),
    "kv_wait_ms": ("pdserve:request_kv_wait_seconds",
                   "Decode worker: parked until the remote prompt KV landed."),
    "decode_queue_ms": ("pdserve:request_decode_queue_seconds",
                        "Decode worker: remote KV landed until the first compute step."),
    "first_step_ms": ("pdserve:request_first_decode_step_seconds",
                      "Decode worker: first compute step until the first token."),
    "decode_ms": ("vllm:request_decode_time_seconds",
                  "Histogram of time spent in DECODE phase for request."),
    "inference_ms": ("vllm:request_inference_time_seconds",
                     "Histogram of time spent in RUNNING phase for request."),
}
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
_N_BUCKETS = (1, 2, 5, 10, 20)  # the n request parameter
# vLLM's finished_reason label values of vllm:request_success_total (FinishReason).
FINISHED_REASONS = ("stop", "length", "abort")

# KV connector gauges (``EngineStats.connector`` keys of both halves), exported as
# ``pdserve:kv_transfer_<key>``. Each but ``releases_waiting`` reads 0 on an idle worker, so
# a soak run can assert that no transfer state or buffer byte leaked. Colocated workers have none of them.
CONNECTOR_GAUGES = {
    "recv_buffer_bytes_in_use": "Receive-buffer bytes reserved for KV loads in flight (D).",
    "send_buffer_bytes_in_use": "Bytes gathered for KV sends not yet completed (P).",
    "pinned_bytes_in_use": "Pinned host bytes holding KV (0: D pushes back, never spills).",
    "loads_pending": "Requests whose remote KV load is scheduled and not finished (D).",
    "loads_in_flight": "KV loads with a pull request sent and data not yet landed (D).",
    "loads_waiting_for_buffer": "KV loads waiting for receive-buffer room (D).",
    "sends_in_flight": "KV sends queued or running on a sender thread (P).",
    "sends_pending_pull": "Computed KV held for a decode worker's pull (P).",
    "pull_requests_waiting": "Pull requests that arrived before their request (P).",
    "releases_waiting": "Releases that arrived before their request (P): they hold no "
                        "bytes or blocks and expire after orphan_ttl_s.",
    "producer_requests": "Prefill requests whose KV is still to be saved (P).",
    "held_requests": "Finished prefill requests whose blocks are held until sent (P).",
    "rank_reports_pending": "Requests whose transfer another tensor-parallel rank has not "
                            "reported ended yet (TP workers).",
}

# Connector gauges an idle worker may show above 0: what they count holds nothing and
# expires by itself.
CONNECTOR_TRANSIENT_GAUGES = frozenset({"releases_waiting"})

# KV connector counters, exported as ``pdserve:kv_transfer_<key>_total``.
CONNECTOR_COUNTERS = {
    "bytes_sent": "KV bytes sent to decode workers (P).",
    "bytes_received": "KV bytes received from prefill workers (D).",
    "transfers_sent": "KV transfers completed by this producer (P).",
    "transfers_received": "KV transfers landed in this consumer's cache (D).",
    "sends_failed": "KV sends that failed (P).",
    "transfers_failed": "KV loads that failed other than by timeout (D).",
    "transfers_timed_out": "KV loads dropped at their deadline (D).",
    "messages_rejected": "Connector control messages rejected by validation.",
    "leases_expired": "Held KV freed at its lease's end, never pulled by a decode worker (P).",
    "registrations_expired": "Pulls that arrived before their prefill and expired waiting (P).",
    "loads_pushed_back": "Times a KV load waited for receive-buffer space (D).",
    "consumer_restarts": "Decode worker processes seen restarted at a known address (P).",
    "loads_streamed": "KV loads larger than kv_buffer_size, received through it in turns (D).",
    "pulls_refused": "Pulls refused for a missing or invalid transfer grant; nothing was sent "
                     "(P).",
    "data_calls": "Data calls (NCCL send/recv or CPU frames) issued.",
    "send_gpu_seconds": "GPU time from a transfer's first send to its end (P, NCCL).",
    "recv_gpu_seconds": "GPU time from posting a transfer's receives (and scatters) to their "
                        "end (D, NCCL).",
}


class _EngineStatsCollector(Collector):
    """Yields engine gauges and counters from the stats snapshot held by ``ServerMetrics``."""

    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Metric]:
        stats, labels = self._owner.engine_stats, [self._owner.model_name, ENGINE_INDEX]
        if stats is None:
            return
        gauges = {
            "vllm:num_requests_running": ("Requests in model execution batches.",
                                          stats.num_running),
            "vllm:num_requests_waiting": ("Requests waiting to be processed.",
                                          stats.num_waiting + stats.num_waiting_for_remote_kv),
            "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.",
                                         stats.kv_cache_usage),
            # vLLM's name before 0.9, still queried by older dashboards and autoscalers.
            "vllm:gpu_cache_usage_perc": ("GPU KV-cache usage (deprecated: "
                                          "vllm:kv_cache_usage_perc). 1 means 100 percent.",
                                          stats.kv_cache_usage),
        }
        for key, doc in CONNECTOR_GAUGES.items():
            if key in stats.connector:
                gauges[f"pdserve:kv_transfer_{key}"] = (doc, stats.connector[key])
        gauges["pdserve:kv_offload_usage_perc"] = (
            "Host KV offload usage (--kv-offloading-size). 1 means 100 percent.",
            stats.kv_offload_usage)
        gauges["pdserve:engine_sleep_level"] = (
            "Sleep mode: 0 awake, else the level the engine sleeps at.", stats.sleep_level)
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            yield family
        counters = {
            "vllm:prompt_tokens": ("Number of prefill tokens processed.",
                                   stats.prompt_tokens_total),
            "vllm:generation_tokens": ("Number of generation tokens processed.",
                                       stats.generation_tokens_total),
            "vllm:prefix_cache_queries": ("Prefix cache queries, in tokens.",
                                          stats.prefix_cache_queries),
            "vllm:prefix_cache_hits": ("Prefix cache hits, in tokens.", stats.prefix_cache_hits),
            "vllm:num_preemptions": ("Cumulative number of preemptions.", stats.num_preemptions),
            "pdserve:kv_offload_stored_blocks": (
                "KV blocks the device evicted that were copied to host memory.",
                stats.kv_offload_stored_blocks),
            "pdserve:kv_offload_loaded_blocks": (
                "Prefix-hit KV blocks copied back from host memory.",
                stats.kv_offload_loaded_blocks),
        }
        for key, doc in CONNECTOR_COUNTERS.items():
            if key in stats.connector:
                counters[f"pdserve:kv_transfer_{key}"] = (doc, stats.connector[key])
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            yield family
        if stats.iteration_token_counts:
            yield _iteration_tokens(stats, labels)


def _iteration_tokens(stats: EngineStats, labels: list[str]) -> HistogramMetricFamily:
    """vLLM's ``iteration_tokens_total``: engine steps by the tokens they ran, from the
    engine's per-bucket counts."""
    family = HistogramMetricFamily("vllm:iteration_tokens_total",
                                   "Histogram of number of tokens per engine_step.",
                                   labels=LABELS)
    cumulative, buckets = 0, []
    for bound, count in zip([*map(float, ITERATION_TOKEN_BUCKETS), float("inf")],
                            stats.iteration_token_counts):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    family.add_metric(labels, buckets, sum_value=stats.iteration_tokens_sum)
    return family


class ServerMetrics:
    """All metrics of one server; ``render()`` gives the Prometheus text."""

    def __init__(self, model_name: str, cache_info: dict[str, str] | None = None) -> None:
        """``cache_info``: the KV cache settings exported as vLLM's ``cache_config_info``
        (an info gauge: labels carry the values, the sample is 1)."""
        self.model_name = model_name
        self._label_values = (model_name, ENGINE_INDEX)
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_stats: EngineStats | None = None
        labels = LABELS
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", labels,
                             buckets=_ITL_BUCKETS, registry=self.registry)
        # vLLM's name of the same observations before inter_token_latency (0.10), which
        # dashboards and autoscalers still query.
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (deprecated: "
                              "vllm:inter_token_latency_seconds).", labels,
                              buckets=_ITL_BUCKETS, registry=self.registry)
        self.request_tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", labels,
            buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end-to-end request latency in seconds.", labels,
                             buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.request_success = Counter("vllm:request_success",
                                       "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        for reason in FINISHED_REASONS:  # present at 0 from the start, as in vLLM
            self.request_success.labels(*self._label_values, reason)
        if cache_info:
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                  LABELS + sorted(cache_info), registry=self.registry).labels(
                *self._label_values, *(cache_info[k] for k in sorted(cache_info))).set(1)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
            buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", labels,
            buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.request_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            labels, buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.request_n = Histogram("vllm:request_params_n",
                                   "Histogram of the n request parameter.", labels,
                                   buckets=_N_BUCKETS, registry=self.registry)
        self.request_max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", labels,
            buckets=_TOKEN_BUCKETS, registry=self.registry)
        # Server-side breakdown of each request (engine_core.server.timings), by key.
        self.breakdown = {
            key: Histogram(name, doc, labels, buckets=_REQUEST_BUCKETS, registry=self.registry)
            for key, (name, doc) in _BREAKDOWN_METRICS.items()}
        # Every request series exists from the start at zero, as in vLLM (a dashboard or an
        # alert on a fresh worker sees 0, not "no data").
        for histogram in (self.ttft, self.itl, self.tpot, self.request_tpot, self.e2e,
                          self.request_prompt_tokens, self.request_generation_tokens,
                          self.request_max_tokens, self.request_n,
                          self.request_max_generation_tokens, *self.breakdown.values()):
            histogram.labels(*self._label_values)
        self.registry.register(_EngineStatsCollector(self))
        self.loop_stalls = Counter("pdserve:event_loop_stalls",
                                   "Times this server's event loop was held over 1 s.",
                                   registry=self.registry)
        self.loop_stall_seconds = Counter("pdserve:event_loop_stall_seconds",
                                          "Seconds this server's event loop was held, in stalls.",
                                          registry=self.registry)
        self.client_write_timeouts = Counter(
            "pdserve:client_write_timeouts",
            "Streams cut because the client took no bytes for --write-timeout (it stopped "
            "reading): its connection aborted and its engine requests with it.",
            registry=self.registry)

    def observe_write_timeout(self) -> None:
        """A streaming client's write waited past ``--write-timeout`` and it was sent away."""
        self.client_write_timeouts.inc()

    def observe_loop_stall(self, seconds: float) -> None:
        """The event loop came back after being held ``seconds`` (engine_core.server.loop_watch)."""
        self.loop_stalls.inc()
        self.loop_stall_seconds.inc(seconds)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(*self._label_values).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.labels(*self._label_values).observe(seconds)
        self.tpot.labels(*self._label_values).observe(seconds)

    def observe_finished(self, e2e_seconds: float, finish_reason: str | None,
                         num_prompt_tokens: int, num_output_tokens: int,
                         max_tokens: int | None, decode_seconds: float | None = None) -> None:
        """One request ended (finished, aborted or failed); ``num_output_tokens`` counts the
        tokens this worker generated, ``decode_seconds`` the time from its first to its last
        (None if it generated none). (The token counters come from the engine.)

        As vLLM V1's finished-request stats: a request that finished by stop, length or
        abort (as the engine reports it) is counted under that reason and in the
        per-request histograms; one that failed (an error) or that its client left (no
        finish reason: vLLM drops its state without stats) is in none of them.
        ``max_tokens``: the request's effective limit (vLLM resolves an absent one to the
        rest of the context before recording it)."""
        if finish_reason in FINISHED_REASONS:
            self.e2e.labels(*self._label_values).observe(e2e_seconds)
            # As vLLM: every finished request, 0 for one without a second token.
            self.request_tpot.labels(*self._label_values).observe(
                decode_seconds / (num_output_tokens - 1)
                if decode_seconds is not None and num_output_tokens > 1 else 0.0)
            self.request_success.labels(*self._label_values, finish_reason).inc()
            self.request_prompt_tokens.labels(*self._label_values).observe(num_prompt_tokens)
            self.request_generation_tokens.labels(*self._label_values).observe(num_output_tokens)
            if max_tokens is not None:
                self.request_max_tokens.labels(*self._label_values).observe(max_tokens)

    def observe_group(self, n: int, max_output_tokens: int) -> None:
        """One prompt's ``n`` samples all finished; the most tokens one of them generated
        (vLLM's sequence-group metrics)."""
        self.request_n.labels(*self._label_values).observe(n)
        self.request_max_generation_tokens.labels(*self._label_values).observe(
            max_output_tokens)

    def observe_breakdown(self, timings: dict[str, float]) -> None:
        """One finished request's ``pdserve_timings`` (milliseconds) into the histograms.

        On a decode worker the vLLM series take vLLM's meaning: a request is scheduled
        once its remote KV has landed and it runs, so its queue time spans the KV wait up
        to its first compute step, and its prefill time is that step to the first token
        (``pdserve:request_kv_wait_seconds`` and the like keep the finer split)."""
        values = dict(timings)
        if "kv_wait_ms" in timings:
            values["queue_ms"] = sum(timings.get(key, 0.0) for key in
                                     ("queue_ms", "kv_wait_ms", "decode_queue_ms"))
            if "first_step_ms" in timings:
                values["prefill_ms"] = timings["first_step_ms"]
        for key, histogram in self.breakdown.items():
            value = values.get(key)
            if value is not None:
                histogram.labels(*self._label_values).observe(max(0.0, value) / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)
