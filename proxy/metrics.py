"""Proxy Prometheus metrics in the app's own CollectorRegistry (no process-global state).

Counters and histograms are updated on the request path; per-worker gauges (in-flight,
heartbeat load, registration counts) are read from the registry at scrape time by a
collector, so a worker that expires simply disappears from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_core.cluster.messages import ROLE_LABELS, ROLES
from proxy.registry import InstanceRegistry

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.5, 1.0)
P = "pdserve:proxy_"


class _RegistryCollector(Collector):
    """Scrape-time view of registered workers and registration-socket counters."""

    def __init__(self, registry: InstanceRegistry,
                 registration_stats: Callable[[], tuple[int, int]],
                 registration_refusals: Callable[[], dict[str, int]]) -> None:
        self._registry = registry
        self._registration_stats = registration_stats
        self._registration_refusals = registration_refusals

    def collect(self) -> Iterable[Metric]:
        workers = self._registry.workers()
        registered = GaugeMetricFamily(P + "registered_workers", "Registered workers by role",
                                       labels=["role"])
        for role in ROLES:
            registered.add_metric([ROLE_LABELS[role]], sum(1 for w in workers if w.role == role))
        labels = ["worker", "role"]
        in_flight = GaugeMetricFamily(P + "worker_in_flight", "Legs in flight per worker", labels=labels)
        running = GaugeMetricFamily(P + "worker_num_requests_running",
                                    "Running requests (last heartbeat)", labels=labels)
        waiting = GaugeMetricFamily(P + "worker_num_requests_waiting",
                                    "Waiting requests (last heartbeat)", labels=labels)
        kv_usage = GaugeMetricFamily(P + "worker_kv_cache_usage_perc",
                                     "KV cache usage 0..1 (last heartbeat)", labels=labels)
        for w in workers:
            key = [w.worker_id, ROLE_LABELS[w.role]]
            in_flight.add_metric(key, w.in_flight)
            running.add_metric(key, w.load.num_running)
            # As the worker's vllm:num_requests_waiting: a decode worker's requests parked
            # for their remote KV wait too.
            waiting.add_metric(key, w.load.num_waiting + w.load.num_waiting_for_remote_kv)
            kv_usage.add_metric(key, w.load.kv_cache_usage)
        received, bad = self._registration_stats()
        messages = CounterMetricFamily(P + "registration_messages", "Registration messages received")
        messages.add_metric([], received)
        bad_messages = CounterMetricFamily(P + "registration_bad_messages",
                                           "Registration messages dropped as malformed")
        bad_messages.add_metric([], bad)
        refused = CounterMetricFamily(
            P + "registration_refusals", "Registration messages refused (forged, stale, "
            "replayed, another worker's identity, over --max-workers), by reason",
            labels=["reason"])
        for reason, count in self._registration_refusals().items():
            refused.add_metric([reason], count)
        return [registered, in_flight, running, waiting, kv_usage, messages, bad_messages,
                refused]


class ProxyMetrics:
    """Every metric the proxy exports; ``render`` gives the /metrics text."""

    def __init__(self, registry: InstanceRegistry,
                 registration_stats: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 registration_refusals: Callable[[], dict[str, int]] = dict) -> None:
        self.collector_registry = CollectorRegistry(auto_describe=True)
        r = self.collector_registry
        self.requests = Counter(P + "requests", "Client requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter(P + "rejected_requests", "Requests refused before routing",
                                ["reason"], registry=r)
        self.in_flight = Gauge(P + "in_flight_requests", "Client requests in flight", registry=r)
        self.routing_decisions = Counter(P + "routing_decisions", "Routing decisions",
                                         ["mode", "prefill", "decode"], registry=r)
        self.retries = Counter(P + "retries", "Request attempts retried", ["reason"], registry=r)
        self.migrations = Counter(
            P + "migrations", "Requests moved to another worker after their decode leg failed "
            "(reason: the failure; limit: --migration-limit reached, not moved)", ["reason"],
            registry=r)
        self.placements = Counter(
            P + "placements",
            "Attempts placed by the placement policy (workers with capabilities): 'local' "
            "(whole on the worker that decodes it) or 'disaggregated' (prefilled on another), "
            "with the rule that decided (proxy/placement.py)", ["placement", "reason"],
            registry=r)
        self.prefill_predicted = Histogram(
            P + "prefill_predicted_seconds",
            "Placed prefills: the policy's predicted time until the prompt's KV is ready, by "
            "the worker that prefills", ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_actual = Histogram(
            P + "prefill_actual_seconds",
            "Placed prefills: measured time until the prompt's KV was ready (a prefill "
            "leg's answer; a whole stream's first byte), by the worker that prefilled",
            ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token_handoffs = Counter(
            P + "first_token_handoffs",
            "Disaggregated requests by how their first token reached the client: 'prefill' "
            "(P's token streamed, D continued), 'decode' (P answered no token: D computed it), "
            "or why the handoff did not apply", ["result"], registry=r)
        self.kv_releases = Counter(
            P + "kv_releases",
            "Releases of KV a prefill worker held for a decode leg that will never pull it "
            "(D refused or failed, or the client left before any D took the request), sent "
            "to P's KV control sockets, by result ('released': handed to every rank; "
            "'failed' (P unreachable) or 'skipped' (too many releases pending): the KV then "
            "waits for its lease)",
            ["result"], registry=r)
        self.layout_refusals = Counter(
            P + "kv_layout_refusals",
            "Requests refused (400) because the chosen prefill and decode workers' KV layouts "
            "cannot be mapped (different model shape, cache dtype or block size)", registry=r)
        self.client_write_timeouts = Counter(
            P + "client_write_timeouts",
            "Streams cut because the client took no bytes for --write-timeout (it stopped "
            "reading): its connection closed and the worker's leg aborted", registry=r)
        self.worker_requests = Counter(P + "worker_requests", "Legs sent per worker",
                                       ["worker", "role"], registry=r)
        self.worker_errors = Counter(P + "worker_errors", "Failed legs per worker",
                                     ["worker", "role", "kind"], registry=r)
        self.worker_latency = Histogram(P + "worker_leg_latency_seconds",
                                        "Leg latency per worker (prefill: whole leg; "
                                        "decode/colocated: until the last byte)",
                                        ["worker", "role"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(P + "queue_time_seconds",
                                    "Arrival to legs dispatched (body read, admission, routing)",
                                    buckets=OVERHEAD_BUCKETS, registry=r)
        self.prefill_leg = Histogram(P + "prefill_leg_seconds",
                                     "Prefill leg latency, dispatch to P's answer",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_byte = Histogram(P + "time_to_first_byte_seconds",
                                            "Arrival to the first byte from D (or colocated)",
                                            ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.request_time = Histogram(P + "request_seconds", "Arrival to the response's end",
                                      ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram(P + "overhead_seconds",
                                  "Proxy's own time: request total minus time waiting on workers",
                                  ["mode"], buckets=OVERHEAD_BUCKETS, registry=r)
        self.loop_stalls = Counter(P + "event_loop_stalls",
                                   "Times the proxy's event loop was held over 1 s", registry=r)
        self.loop_stall_seconds = Counter(P + "event_loop_stall_seconds",
                                          "Seconds the proxy's event loop was held, in stalls",
                                          registry=r)
        r.register(_RegistryCollector(registry, registration_stats, registration_refusals))
        registry.add_removal_listener(self.forget_worker)

    def forget_worker(self, worker_id: str) -> None:
        """Drop every series labelled with a worker that left: with workers restarting at
        new ports (or P x D pairs in the routing counts) the series would grow for good."""
        per_worker = ((self.worker_requests, ("worker", "role")),
                      (self.worker_errors, ("worker", "role", "kind")),
                      (self.worker_latency, ("worker", "role")),
                      (self.routing_decisions, ("mode", "prefill", "decode")),
                      (self.prefill_predicted, ("worker",)), (self.prefill_actual, ("worker",)))
        for metric, names in per_worker:
            stale = set()
            for family in metric.collect():
                for sample in family.samples:
                    values = tuple(sample.labels.get(name, "") for name in names)
                    if worker_id in values:
                        stale.add(values)
            for values in stale:
                metric.remove(*values)

    def observe_loop_stall(self, seconds: float) -> None:
        """The event loop came back after being held ``seconds`` (engine_core.server.loop_watch)."""
        self.loop_stalls.inc()
        self.loop_stall_seconds.inc(seconds)

    def render(self) -> bytes:
        """Prometheus text exposition of every metric."""
        return generate_latest(self.collector_registry)
