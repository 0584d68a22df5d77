"""One client request's legs: their book-keeping, timestamps and retry signal.

A leg is one HTTP request to one worker (P's prefill, D's decode, or a whole request).
``Leg`` keeps the registry's in-flight counts and the per-worker metrics right however the
leg ends; ``RequestTimer`` holds the request's timestamps for the breakdown headers.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from engine_core.cluster.messages import CAP_DECODE, CAP_PREFILL, CAP_WHOLE, ROLE_LABELS
from engine_core.errors import UpstreamError
from proxy.metrics import ProxyMetrics
from proxy.registry import Clock, InstanceRegistry, WorkerState


class LegOwner(Protocol):
    """What a leg records into: the dispatcher's registry, metrics and clock."""

    registry: InstanceRegistry
    metrics: ProxyMetrics
    clock: Clock


@dataclass
class RequestTimer:
    """Per-request timestamps on the proxy's clock (seconds)."""

    arrival: float
    mode: str | None = None              # route mode of the latest attempt
    dispatched: float | None = None      # first leg sent
    prefill_done: float | None = None    # P answered (successful attempt)
    prefill_sent: float | None = None    # that attempt's legs sent
    first_byte: float | None = None      # first byte from D / colocated
    upstream_done: float | None = None   # last byte needed from a worker
    prefill_timings: dict[str, Any] | None = None  # P's ``pdserve_timings``, when it sent them


class Retry(Exception):
    """An attempt failed before any byte went out; try again without ``worker``."""

    def __init__(self, worker: WorkerState, error: UpstreamError, reason: str) -> None:
        super().__init__(str(error))
        self.worker = worker
        self.error = error
        self.reason = reason


@dataclass(frozen=True)
class HeldKV:
    """The KV a prefill worker holds for one attempt: its transfers, the decode worker
    named to pull them (a release names it: its grant covers the pair)."""

    prefill: WorkerState
    decode: WorkerState
    transfer_ids: list[str]
    grant: str  # the transfers' grant naming prefill and decode


def took_nothing(status: int) -> bool:
    """A decode worker's 4xx: it refused the request before its engine took it, so it
    will never pull (nor release) the KV P computed for it."""
    return 400 <= status < 500


class Leg:
    """Book-keeping for one leg: registry in-flight count and per-worker metrics."""

    def __init__(self, dispatcher: LegOwner, worker: WorkerState, role: str,
                 prefill_tokens: int = 0) -> None:
        self._d = dispatcher
        self.worker = worker
        self.role = role  # the leg's part in the request, for logs and retry reasons
        # The metrics' role label is the worker's role, as in the heartbeat gauges.
        self.role_label = ROLE_LABELS.get(worker.role, role)
        # Its capability in use, for /instances' role mix.
        self.part = {"prefill": CAP_PREFILL, "decode": CAP_DECODE}.get(role, CAP_WHOLE)
        self.started = dispatcher.clock()
        self._finished = False
        # Prompt tokens this leg computes (placed requests): pending in the registry until
        # the prompt is done, so the next placement sees the queue before a heartbeat does.
        self._prefill_tokens = prefill_tokens
        dispatcher.registry.leg_started(worker.worker_id)
        dispatcher.registry.part_started(worker.worker_id, self.part, prefill_tokens)
        dispatcher.metrics.worker_requests.labels(worker.worker_id, self.role_label).inc()

    def prefill_done(self, measured: bool = True) -> None:
        """This leg's prompt is computed (once): its tokens leave the worker's pending
        count and, ``measured``, the time so far is the prefill's actual time."""
        if not self._prefill_tokens:
            return
        tokens, self._prefill_tokens = self._prefill_tokens, 0
        wid = self.worker.worker_id
        self._d.registry.prefill_answered(wid, tokens)
        if measured and self._d.registry.get(wid) is not None:
            self._d.metrics.prefill_actual.labels(wid).observe(self._d.clock() - self.started)

    def finish(self, error: UpstreamError | None = None, aborted: bool = False) -> None:
        """Record the leg's end once: ok, failed with ``error``, or aborted by the proxy."""
        if self._finished:
            return
        self._finished = True
        self.prefill_done(measured=False)
        wid = self.worker.worker_id
        self._d.registry.part_finished(wid, self.part)
        self._d.registry.leg_finished(wid, ok=error is None,
                                      connection_failed=error is not None and error.connect_failed)
        if self._d.registry.get(wid) is None:
            return  # the worker left: its series were dropped, and recording would revive them
        if error is not None:
            self._d.metrics.worker_errors.labels(wid, self.role_label, error.kind).inc()
        elif not aborted:
            self._d.metrics.worker_latency.labels(wid, self.role_label).observe(
                self._d.clock() - self.started)


class InflightLimiter:
    """Counts client requests in flight and refuses beyond ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def try_acquire(self) -> bool:
        """Take a slot; False when all are taken."""
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def release(self) -> None:
        self.count = max(0, self.count - 1)


def breakdown_headers(timer: RequestTimer) -> dict[str, str]:
    """Known before the first byte: the proxy's queueing and P's server-side timings.

    Headers, so D's body passes through unchanged; a benchmark joins them with the
    ``pdserve_timings`` D puts in its final chunk.
    """
    headers: dict[str, str] = {}
    if timer.dispatched is not None:
        headers["X-Pdserve-Queue-Ms"] = f"{(timer.dispatched - timer.arrival) * 1e3:.3f}"
    if timer.prefill_timings:
        headers["X-Pdserve-Prefill-Timings"] = json.dumps(timer.prefill_timings,
                                                          separators=(",", ":"))
    return headers


def server_timings(body: bytes) -> dict[str, Any] | None:
    """The ``pdserve_timings`` object of a worker's JSON answer, if it has one."""
    try:
        value = json.loads(body).get("pdserve_timings")
    except (ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def proxy_overhead(timer: RequestTimer, now: float) -> float | None:
    """The proxy's own time so far: total minus the span spent waiting on workers."""
    if timer.dispatched is None or timer.upstream_done is None:
        return None
    return max(0.0, (now - timer.arrival) - (timer.upstream_done - timer.dispatched))



async def abort_tasks(*tasks: asyncio.Task[Any]) -> None:
    """Cancel unfinished legs and close responses nobody consumed, closing their connections."""
    for task in tasks:
        if not task.done():
            task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, aiohttp.ClientResponse):
            result.close()  # no-op when already released after a complete read
