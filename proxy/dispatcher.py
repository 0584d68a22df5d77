"""Dispatcher: one client request -> route -> legs -> the client's response.

Disaggregated attempt: both legs leave at once; P's answer (one token, no stream) is awaited
first while D's early refusal is watched; then D's answer is relayed. Failure rules:

- P fails (connect, disconnect, timeout, 5xx) before any byte reached the client: D's leg
  is aborted and the request is tried again without that P, which becomes decode-only on
  D when no other P is left (``routing.plan_route``). Each retry gets the transfer id
  ``T-retryN`` so a late KV transfer of an aborted attempt can never match the new one.
- D (or a colocated worker) cannot be connected to: tried again without it.
- A worker's 4xx is forwarded unchanged; D's 503 (asleep, not ready) before any byte went
  out is tried again without that worker (the heartbeat that says it sleeps may still be on
  its way); D's other 5xx, timeout or an empty answer before any byte went out is a 502/504
  with an OpenAI error body, never a 200 with an empty body.
- After bytes went out, an upstream failure (or a stream ending without ``[DONE]``) ends the
  stream with an SSE ``data: {"error": ...}`` event and ``data: [DONE]``.
- Cancellation (client gone; the server runs with handler cancellation) closes every leg.
- KV that P computed for a D that will never pull it is released through D at once
  (``_release``), not left to P's lease: D refused the request (a 4xx: its engine never
  took it) after P computed it, or while P still ran it (P's leg is then awaited in the
  background, ``_settle_prefill``, not cut); or a handoff's client left before any D took
  the request (``_settle_decode`` learns which from D's answer). P's own request is the
  client's (``forwarding.producer_body``), validated there as D validates it, so what D
  refuses P refuses first in the common case, computing nothing.
- A streaming client that takes no bytes for ``write_timeout_s`` (it stopped reading) has
  its connection aborted (``engine_core.server.streaming.SSEStream``), which then ends as a
  client that left does.

First-token handoff (``--first-token-from-prefill``, streams without stop strings or
logprobs): P alone first; the stream events of P's sampled token go to the client as soon
as P answers, then D's leg leaves carrying that token and D streams what follows it. The
client's first token then costs P's prefill and nothing of D (``_run_pd_handoff``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.messages import ROLE_COLOCATED, ROLE_DECODE, ROLE_LABELS
from engine_core.cluster.trust import ClusterSecret
from engine_core.errors import NoWorkerError
from engine_core.server.streaming import ClientStalledError, SSEStream, WriteBound
from proxy import forwarding as fw
from proxy.errors import (
    UpstreamError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
    sse_error_event,
)
from proxy.metrics import ProxyMetrics
from proxy.registry import Clock, InstanceRegistry, WorkerState
from proxy.routing import MODE_PD, Route, RoutingPolicy, plan_route

logger = logging.getLogger(__name__)


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


class _Retry(Exception):
    """An attempt failed before any byte went out; try again without ``worker``."""

    def __init__(self, worker: WorkerState, error: UpstreamError, reason: str) -> None:
        super().__init__(str(error))
        self.worker = worker
        self.error = error
        self.reason = reason


@dataclass(frozen=True)
class _HeldKV:
    """The KV a prefill worker holds for one attempt: its transfers, the decode worker
    named to pull them (and through which a release reaches P), the legs' headers."""

    prefill: WorkerState
    decode: WorkerState
    transfer_ids: list[str]
    headers: dict[str, str]
    grant: str  # the transfers' grant naming prefill and decode


def _took_nothing(status: int) -> bool:
    """A decode worker's 4xx: it refused the request before its engine took it, so it
    will never pull (nor release) the KV P computed for it."""
    return 400 <= status < 500


class _Leg:
    """Book-keeping for one leg: registry in-flight count and per-worker metrics."""

    def __init__(self, dispatcher: Dispatcher, worker: WorkerState, role: str) -> None:
        self._d = dispatcher
        self.worker = worker
        self.role = role  # the leg's part in the request, for logs and retry reasons
        # The metrics' role label is the worker's role, as in the heartbeat gauges.
        self.role_label = ROLE_LABELS.get(worker.role, role)
        self.started = dispatcher.clock()
        self._finished = False
        dispatcher.registry.leg_started(worker.worker_id)
        dispatcher.metrics.worker_requests.labels(worker.worker_id, self.role_label).inc()

    def finish(self, error: UpstreamError | None = None, aborted: bool = False) -> None:
        """Record the leg's end once: ok, failed with ``error``, or aborted by the proxy."""
        if self._finished:
            return
        self._finished = True
        wid = self.worker.worker_id
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


class Dispatcher:
    """Routes requests and runs their legs; holds no per-request state between calls."""

    def __init__(self, *, registry: InstanceRegistry, policy: RoutingPolicy,
                 metrics: ProxyMetrics, session: aiohttp.ClientSession, timeouts: fw.LegTimeouts,
                 clock: Clock, max_attempts: int = 3, max_response_bytes: int = 64 << 20,
                 affinity_prefix_chars: int = 256, first_token_from_prefill: bool = False,
                 prefill_overflow: int = 0, write_timeout_s: float = 60.0,
                 limiter: InflightLimiter | None = None,
                 grants: GrantAuthority | None = None) -> None:
        self.registry = registry
        # Signs each request's transfer grant (P, D, transfer id), attached to both legs.
        self.grants = grants or GrantAuthority(ClusterSecret())
        self.policy = policy
        self.metrics = metrics
        self.session = session
        self.timeouts = timeouts
        self.clock = clock
        self.max_attempts = max_attempts
        self.max_response_bytes = max_response_bytes
        self.affinity_prefix_chars = affinity_prefix_chars
        self.first_token_from_prefill = first_token_from_prefill
        self.prefill_overflow = prefill_overflow
        self.write_timeout_s = write_timeout_s
        # Work that outlives its client request: settling a leg whose outcome decides
        # whether P must drop KV, and the releases themselves (``aclose`` ends them).
        self._background: set[asyncio.Task[None]] = set()
        # Each background task holds a slot of the client requests' limiter (--max-inflight)
        # while it runs: a leg left running is load on its worker like a client's request.
        self.limiter = limiter or InflightLimiter(1 << 30)

    def _grant(self, transfer_id: str, prefill: WorkerState, decode: WorkerState) -> str:
        """The grant moving ``transfer_id``'s KV from ``prefill`` to ``decode``, valid while
        either leg may still run."""
        return self.grants.issue(transfer_id, prefill.zmq_address or prefill.worker_id,
                                 decode.zmq_address or decode.worker_id,
                                 self.timeouts.prefill_s + self.timeouts.decode_s)

    async def aclose(self) -> None:
        """Cancel the background settles and releases (shutdown, before the session closes)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> bool:
        """Run ``work`` in the background under a slot of the limiter; False (``work``
        closed unrun) when every slot is taken: the caller then cuts its leg and leaves P's
        KV to its lease, as before background settles existed, so refusals that arrive
        faster than P computes cannot pile up work beyond --max-inflight."""
        if not self.limiter.try_acquire():
            work.close()
            self.metrics.kv_releases.labels("skipped").inc()
            return False
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return True

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        self.limiter.release()
        if not task.cancelled() and task.exception() is not None:
            logger.error("background work failed", exc_info=task.exception())

    async def dispatch(self, request: web.Request, path: str, body: dict[str, Any],
                       transfer_id: str, timer: RequestTimer,
                       generates: bool = True) -> web.StreamResponse:
        """Serve one validated request body; raise a PdserveError for an error status.

        ``generates`` False (/tokenize, /detokenize): one worker that can answer it
        whole (D or colocated) gets the request, with the same retries."""
        model = body.get("model") if isinstance(body.get("model"), str) else None
        key = fw.affinity_key(path, body, self.affinity_prefix_chars)
        excluded: set[str] = set()
        last_error: UpstreamError | None = None
        handoff_counted = False  # the handoff metric counts requests, not attempts
        for attempt in range(self.max_attempts):
            attempt_id = transfer_id if attempt == 0 else f"{transfer_id}-retry{attempt}"
            try:
                route = plan_route(self.registry, self.policy, model, excluded, key,
                                   self.prefill_overflow if generates else 0)
            except NoWorkerError:
                if last_error is not None:
                    raise last_error from None
                raise
            self.metrics.routing_decisions.labels(
                route.mode, route.prefill.worker_id if route.prefill else "",
                route.decode.worker_id).inc()
            timer.mode = route.mode
            if timer.dispatched is None:
                timer.dispatched = self.clock()
            try:
                if route.mode == MODE_PD and generates:
                    refusal = (fw.handoff_refusal(path, body) if self.first_token_from_prefill
                               else "off")
                    if refusal is None:
                        return await self._run_pd_handoff(request, path, body, route,
                                                          attempt_id, timer, model, key)
                    if refusal != "off" and not handoff_counted:
                        handoff_counted = True
                        self.metrics.first_token_handoffs.labels(refusal).inc()
                    return await self._run_pd(request, path, body, route, attempt_id, timer)
                return await self._run_one_leg(request, path, fw.decode_body(body, attempt_id, None),
                                               route.decode, route.mode, attempt_id, timer)
            except _Retry as retry:
                logger.warning("request %s: %s failed (%s); retrying without %s", attempt_id,
                               route.describe(), retry.error, retry.worker.worker_id)
                self.metrics.retries.labels(retry.reason).inc()
                excluded.add(retry.worker.worker_id)
                last_error = retry.error
        assert last_error is not None
        raise last_error

    async def _run_pd(self, request: web.Request, path: str, body: dict[str, Any], route: Route,
                      attempt_id: str, timer: RequestTimer) -> web.StreamResponse:
        prefill, decode = route.prefill, route.decode
        assert prefill is not None and prefill.zmq_address and decode.zmq_address
        headers = fw.leg_headers(request.headers, attempt_id)
        grant = self._grant(attempt_id, prefill, decode)
        held = _HeldKV(prefill, decode, fw.prompt_transfer_ids(path, body, attempt_id), headers,
                       grant)
        p_leg, d_leg = _Leg(self, prefill, "prefill"), _Leg(self, decode, "decode")
        timer.prefill_sent = self.clock()
        p_task = asyncio.create_task(self._prefill(
            prefill.url + path, fw.prefill_body(body, attempt_id, decode.zmq_address, grant),
            headers))
        d_task = asyncio.create_task(fw.open_leg(
            self.session, decode.url + path,
            fw.decode_body(body, attempt_id, prefill.zmq_address, grant),
            headers, self.timeouts.decode()))
        p_settling = False  # P's leg handed to ``_settle_prefill``
        try:
            pending: set[asyncio.Task[Any]] = {p_task, d_task}
            while not p_task.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if d_task in done and not p_task.done():
                    d_response = await self._decode_response(d_task, d_leg)
                    if not 200 <= d_response.status < 300:  # D refused: its answer stands
                        if _took_nothing(d_response.status):
                            p_settling = self._spawn(self._settle_prefill(p_task, p_leg, held))
                        return await self._forward_refusal(d_response, d_leg, attempt_id)
            verdict = self._prefill_verdict(p_task, p_leg, attempt_id, timer)
            if isinstance(verdict, web.Response):
                return verdict
            d_response = await self._decode_response(d_task, d_leg)
            if not 200 <= d_response.status < 300:
                if _took_nothing(d_response.status):  # P holds KV D will never pull
                    self._spawn(self._release(held))
                return await self._forward_refusal(d_response, d_leg, attempt_id)
            return await self._relay(request, d_response, d_leg, attempt_id, timer)
        finally:
            d_leg.finish(aborted=True)
            if p_settling:
                await _abort(d_task)
            else:
                p_leg.finish(aborted=True)
                await _abort(p_task, d_task)

    async def _settle_prefill(self, p_task: asyncio.Task[tuple[int, str, bytes]], p_leg: _Leg,
                              held: _HeldKV) -> None:
        """P's leg of a request D refused while P still ran it: awaited in the background
        (its own deadline bounds it) and its KV released once P says it computed it.

        Not cancelled: an abort landing after P's save left the KV held for the lease, and
        a release sent for a request P never took would wait in P as a pull of its own."""
        try:
            await asyncio.wait({p_task})
            try:
                status, _, _ = p_task.result()
            except UpstreamError as err:
                p_leg.finish(err)
                return
            p_leg.finish(None if status < 500 else UpstreamError(
                f"prefill worker {p_leg.worker.worker_id} answered {status}", kind="status",
                status=status))
            if 200 <= status < 300:
                await self._release(held)
        finally:
            p_leg.finish(aborted=True)
            await _abort(p_task)

    async def _settle_decode(self, d_task: asyncio.Task[aiohttp.ClientResponse], d_leg: _Leg,
                             held: _HeldKV) -> None:
        """D's leg of a handoff whose client left before D answered: whether D took the
        request decides who frees the KV P holds for it, and D's answer says which. A
        stream (its engine runs the request) is closed, which aborts it there and D's
        connector frees or releases the KV; a 4xx took nothing, so P is told directly."""
        try:
            await asyncio.wait({d_task})
            try:
                response = d_task.result()
            except UpstreamError as err:
                d_leg.finish(err)
                return
            status = response.status
            response.close()
            if _took_nothing(status):
                d_leg.finish()
                await self._release(held)
        finally:
            d_leg.finish(aborted=True)
            await _abort(d_task)

    async def _release(self, held: _HeldKV) -> None:
        """Make P drop KV that no decode leg will pull (its request refused by D, or its
        client gone before any D took it) now, not when its lease ends: D's release
        endpoint has its KV connector tell P, as it does for a request it aborts. Best
        effort: a failure leaves the KV to the lease."""
        url = held.decode.url + fw.RELEASE_PATH
        assert held.prefill.zmq_address is not None
        body = fw.release_body(held.transfer_ids, held.prefill.zmq_address, held.grant)
        try:
            response = await fw.open_leg(self.session, url, body, held.headers,
                                         self.timeouts.release())
            try:
                data = await fw.read_body(response, 64 << 10)
            finally:
                response.close()
        except UpstreamError as err:
            self.metrics.kv_releases.labels("failed").inc()
            logger.warning("KV of %s on %s not released (its lease frees it): %s",
                           held.transfer_ids[0], held.prefill.worker_id, err)
            return
        if not 200 <= response.status < 300:
            self.metrics.kv_releases.labels("failed").inc()
            logger.warning("KV of %s on %s not released (its lease frees it): %s answered "
                           "%d: %s", held.transfer_ids[0], held.prefill.worker_id,
                           held.decode.worker_id, response.status,
                           data[:300].decode(errors="replace"))
            return
        self.metrics.kv_releases.labels("released").inc()

    def _prefill_verdict(self, p_task: asyncio.Task[tuple[int, str, bytes]], p_leg: _Leg,
                         attempt_id: str, timer: RequestTimer) -> bytes | web.Response:
        """P's answer body when it succeeded; its 4xx verdict as the client's response; a
        retry without P when it failed (raises ``_Retry``)."""
        try:
            p_status, p_type, p_data = p_task.result()
        except UpstreamError as err:
            p_leg.finish(err)
            raise _Retry(p_leg.worker, err, f"prefill_{err.kind}") from None
        if p_status >= 500:
            err = UpstreamError(f"prefill worker {p_leg.worker.worker_id} answered {p_status}",
                                kind="status", status=p_status)
            p_leg.finish(err)
            raise _Retry(p_leg.worker, err, "prefill_status")
        p_leg.finish()
        if p_status >= 300:  # the worker judged the request: pass its verdict on
            return web.Response(status=p_status, body=p_data, content_type=p_type,
                                headers={"X-Request-Id": attempt_id})
        timer.prefill_done = self.clock()
        timer.prefill_timings = _server_timings(p_data)
        return p_data

    async def _run_pd_handoff(self, request: web.Request, path: str, body: dict[str, Any],
                              route: Route, attempt_id: str, timer: RequestTimer,
                              model: str | None, key: str | None) -> web.StreamResponse:
        """P first; its sampled token goes to the client at once and D continues after it.

        D's leg leaves only once P answered (it must carry P's token), so D pulls the
        prompt's KV from the blocks P holds for it. Until P answered nothing went out and a
        failure is retried as in ``_run_pd``; after that the stream is the client's, and a D
        that cannot be reached (or is asleep) is replaced by another decode worker: it never
        got the request, so P's held KV is still there for the next one to pull (a failed
        pull falls back to computing the prompt there). Anything else ends the stream with
        an SSE error event (a D's 4xx also releases P's KV). ``model`` and ``key`` route
        that replacement as the request was routed.
        """
        prefill, decode = route.prefill, route.decode
        assert prefill is not None and prefill.zmq_address and decode.zmq_address
        headers = fw.leg_headers(request.headers, attempt_id)
        p_leg = _Leg(self, prefill, "prefill")
        timer.prefill_sent = self.clock()
        grant = self._grant(attempt_id, prefill, decode)
        p_task = asyncio.create_task(self._prefill(
            prefill.url + path, fw.handoff_prefill_body(body, attempt_id, decode.zmq_address,
                                                        grant),
            headers))
        try:
            await asyncio.wait({p_task})
            verdict = self._prefill_verdict(p_task, p_leg, attempt_id, timer)
        finally:
            p_leg.finish(aborted=True)
            await _abort(p_task)
        if isinstance(verdict, web.Response):
            return verdict
        held = _HeldKV(prefill, decode, fw.prompt_transfer_ids(path, body, attempt_id), headers,
                       grant)
        first = fw.first_token_of(verdict)
        if first is None:  # an older P, or one that sampled nothing: D computes the token
            # Counted unless this D sends the request round again (unreachable, asleep):
            # then the attempt that serves it counts it, so one request counts once.
            retried = False
            try:
                response = await self._run_one_leg(
                    request, path, fw.decode_body(body, attempt_id, prefill.zmq_address, grant),
                    decode, "decode", attempt_id, timer)
                if _took_nothing(response.status):  # P holds KV D will never pull
                    self._spawn(self._release(held))
                return response
            except _Retry:
                retried = True
                raise
            finally:
                if not retried:
                    self.metrics.first_token_handoffs.labels("decode").inc()
        self.metrics.first_token_handoffs.labels("prefill").inc()
        out = web.StreamResponse(status=200, headers={
            "Content-Type": fw.SSE_CONTENT_TYPE, "Cache-Control": "no-cache",
            "X-Request-Id": attempt_id, **breakdown_headers(timer)})
        try:
            stream = await self._open_stream(request, out)
            await stream.write(first.events)
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            # The client left before any decode leg went out: nobody will pull P's KV.
            self._spawn(self._release(held))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return out
        timer.first_byte = self.clock()
        excluded = {prefill.worker_id}
        granted = decode
        for attempt in range(self.max_attempts):
            if decode is not granted:  # a replacement decode worker: its own grant
                grant, granted = self._grant(attempt_id, prefill, decode), decode
            d_body = fw.handoff_decode_body(body, attempt_id, prefill.zmq_address,
                                            first.token_ids, grant)
            d_leg = _Leg(self, decode, "decode")
            held = dataclasses.replace(held, decode=decode, grant=grant)
            d_task = asyncio.create_task(fw.open_leg(
                self.session, decode.url + path, d_body, headers, self.timeouts.decode()))
            settling = False  # D's leg handed to ``_settle_decode``
            try:
                try:
                    try:
                        # Not ``await d_task``: a client leaving now would cancel the leg
                        # with it, and whether D took the request (its abort then frees the
                        # KV) or not (P must be told) would stay unknown.
                        await asyncio.wait({d_task})
                    except asyncio.CancelledError:
                        settling = self._spawn(self._settle_decode(d_task, d_leg, held))
                        raise
                    d_response = d_task.result()
                    if d_response.status == 503 and attempt + 1 < self.max_attempts:
                        data = await fw.read_body(d_response, self.max_response_bytes)
                        raise UpstreamUnavailableError(
                            f"decode worker {decode.worker_id} is unavailable: "
                            f"{data[:300].decode(errors='replace')}")
                except UpstreamError as err:
                    d_leg.finish(err)
                    if not (err.connect_failed or isinstance(err, UpstreamUnavailableError)) \
                            or attempt + 1 == self.max_attempts:
                        return await _end_stream(stream, err)
                    excluded.add(decode.worker_id)
                    # Another decode worker (it pulls the KV P holds); only when none is left
                    # a colocated one, which recomputes the prompt (P's hold then lapses with
                    # its lease): routing the usual way would skip the decode workers, since
                    # with P excluded no (P, D) pair remains.
                    role = ROLE_DECODE
                    others = self.registry.candidates(role, model, excluded)
                    if not others:
                        role = ROLE_COLOCATED
                        others = self.registry.candidates(role, model, excluded)
                    if not others:
                        return await _end_stream(stream, err)
                    decode = self.policy.choose(role, others, key)
                    logger.warning("request %s: decode leg failed before its first byte (%s); "
                                   "continuing on %s", attempt_id, err, decode.worker_id)
                    self.metrics.retries.labels("handoff_decode").inc()
                    continue
                if not 200 <= d_response.status < 300 or not fw.is_event_stream(d_response):
                    try:
                        data = await fw.read_body(d_response, self.max_response_bytes)
                    except UpstreamError as exc:  # the refusal's body itself failed
                        data = str(exc).encode()
                    err = UpstreamError(
                        f"decode worker {decode.worker_id} answered {d_response.status}: "
                        f"{data[:500].decode(errors='replace')}", kind="status",
                        status=d_response.status)
                    d_leg.finish(err)
                    if _took_nothing(d_response.status):  # P holds KV D will never pull
                        self._spawn(self._release(held))
                    return await _end_stream(stream, err)
                return await self._stream_into(stream, d_response, d_leg, attempt_id, timer, b"")
            finally:
                if not settling:
                    d_leg.finish(aborted=True)
                    await _abort(d_task)
        raise AssertionError("unreachable: the last attempt returns")

    async def _run_one_leg(self, request: web.Request, path: str, leg_body: dict[str, Any],
                           worker: WorkerState, role: str, attempt_id: str,
                           timer: RequestTimer) -> web.StreamResponse:
        """One worker's leg relayed to the client: a colocated or decode-only request, or
        D's leg once P has answered (``role`` "decode")."""
        leg = _Leg(self, worker, role)
        task = asyncio.create_task(fw.open_leg(
            self.session, worker.url + path, leg_body,
            fw.leg_headers(request.headers, attempt_id), self.timeouts.decode()))
        try:
            response = await self._decode_response(task, leg)
            if not 200 <= response.status < 300:
                return await self._forward_refusal(response, leg, attempt_id)
            return await self._relay(request, response, leg, attempt_id, timer)
        finally:
            leg.finish(aborted=True)
            await _abort(task)

    async def _prefill(self, url: str, body: dict[str, Any],
                       headers: dict[str, str]) -> tuple[int, str, bytes]:
        """The whole prefill leg under its deadline: (status, content type, body)."""

        async def run() -> tuple[int, str, bytes]:
            response = await fw.open_leg(self.session, url, body, headers, self.timeouts.prefill())
            try:
                data = await fw.read_body(response, self.max_response_bytes)
            finally:
                response.close()
            return response.status, response.content_type, data

        try:
            return await asyncio.wait_for(run(), self.timeouts.prefill_s)
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeoutError(f"prefill leg to {url} exceeded "
                                       f"{self.timeouts.prefill_s}s") from exc

    async def _decode_response(self, task: asyncio.Task[aiohttp.ClientResponse],
                               leg: _Leg) -> aiohttp.ClientResponse:
        """D's (or a colocated worker's) response headers; retry when it was unreachable."""
        try:
            return await task
        except UpstreamError as err:
            leg.finish(err)
            if err.connect_failed:
                raise _Retry(leg.worker, err, f"{leg.role}_connect") from None
            raise

    async def _forward_refusal(self, response: aiohttp.ClientResponse, leg: _Leg,
                               attempt_id: str) -> web.StreamResponse:
        """Pass a worker's 4xx on unchanged; a 503 (asleep, or not ready) is tried again
        on another worker; any other 5xx becomes a 502 with an error body."""
        data = await fw.read_body(response, self.max_response_bytes)
        if response.status == 503:
            err = UpstreamUnavailableError(
                f"{leg.role} worker {leg.worker.worker_id} is unavailable: "
                f"{data[:300].decode(errors='replace')}")
            leg.finish(err)
            raise _Retry(leg.worker, err, f"{leg.role}_unavailable")
        if response.status < 500:
            leg.finish()
            return web.Response(status=response.status, body=data,
                                content_type=response.content_type,
                                headers={"X-Request-Id": attempt_id})
        err = UpstreamError(f"{leg.role} worker {leg.worker.worker_id} answered "
                            f"{response.status}: {data[:500].decode(errors='replace')}",
                            kind="status", status=response.status)
        leg.finish(err)
        raise err

    async def _relay(self, request: web.Request, response: aiohttp.ClientResponse, leg: _Leg,
                     attempt_id: str, timer: RequestTimer) -> web.StreamResponse:
        if not fw.is_event_stream(response):
            try:
                data = await fw.read_body(response, self.max_response_bytes)
            except UpstreamError as err:
                leg.finish(err)
                raise
            timer.first_byte = timer.upstream_done = self.clock()
            if not data:
                err = UpstreamError(f"{leg.role} worker {leg.worker.worker_id} answered an "
                                    "empty body", kind="empty")
                leg.finish(err)
                raise err
            leg.finish()
            headers = {"X-Request-Id": attempt_id, **self._timing_headers(timer)}
            return await self._send_whole(request, response.status, data,
                                          response.content_type, headers)
        first = b""
        try:
            first = await fw.read_chunk(response)
        except UpstreamError as err:
            leg.finish(err)
            raise
        if not first:
            err = UpstreamError(f"{leg.role} worker {leg.worker.worker_id} ended its stream "
                                "before any event", kind="empty")
            leg.finish(err)
            raise err
        timer.first_byte = self.clock()
        out = web.StreamResponse(status=response.status, headers={
            "Content-Type": fw.SSE_CONTENT_TYPE, "Cache-Control": "no-cache",
            "X-Request-Id": attempt_id, **breakdown_headers(timer)})
        stream = await self._open_stream(request, out)
        return await self._stream_into(stream, response, leg, attempt_id, timer, first)

    async def _send_whole(self, request: web.Request, status: int, data: bytes,
                          content_type: str, headers: dict[str, str]) -> web.StreamResponse:
        """A whole answer written here under the write bound, as streams are (aiohttp's own
        final write, after the handler returned, waits without limit on a client that does
        not read, holding the connection and up to --max-response-bytes of body)."""
        out = web.StreamResponse(status=status, headers=headers)
        out.content_type = content_type
        out.content_length = len(data)
        stream = await self._open_stream(request, out)
        with contextlib.suppress(ClientStalledError):  # aborted, counted, logged
            await stream.write(data)
            await stream.write_eof()
        return out

    async def _open_stream(self, request: web.Request,
                           out: web.StreamResponse) -> SSEStream:
        """``_open_stream`` with this proxy's write bound."""
        return await _open_stream(request, out, WriteBound(self.write_timeout_s,
                                                           self._on_write_stall))

    def _on_write_stall(self, request: web.Request) -> None:
        """A streaming client took no bytes for the write bound: count and log it (its
        connection is aborted, which closes the legs and frees the slot)."""
        self.metrics.client_write_timeouts.inc()
        logger.warning("request %s: the client took no bytes for %g s (not reading); its "
                       "connection is closed and the request aborted",
                       request.headers.get("X-Request-Id", "-"), self.write_timeout_s)

    async def _stream_into(self, stream: SSEStream, response: aiohttp.ClientResponse,
                           leg: _Leg, attempt_id: str, timer: RequestTimer,
                           first: bytes) -> web.StreamResponse:
        """Copy a worker's event stream (after ``first``, already read) to the prepared
        client response; a failure after bytes went out ends it with an SSE error event."""
        tracker = fw.SSETracker()
        chunk = first
        try:
            if not chunk:
                chunk = await fw.read_chunk(response)
            while chunk:
                await stream.write(chunk)
                tracker.feed(chunk)
                chunk = await fw.read_chunk(response)
            timer.upstream_done = self.clock()
            if not tracker.done_seen:
                raise UpstreamError(f"{leg.role} worker {leg.worker.worker_id} ended its "
                                    "stream without [DONE]", kind="disconnect")
            leg.finish()
        except UpstreamError as err:
            leg.finish(err)
            logger.warning("request %s: stream from %s failed after bytes went out: %s",
                           attempt_id, leg.worker.worker_id, err)
            try:
                await stream.write((b"" if tracker.at_event_boundary else b"\n\n")
                                   + sse_error_event(err))
            except ConnectionResetError:
                return stream.response
        except ConnectionResetError:
            # The client went away, or was sent away (streaming.ClientStalledError): the caller's
            # finally closes the legs.
            return stream.response
        try:
            await stream.write_eof()
        except ConnectionResetError:
            pass
        return stream.response

    def _timing_headers(self, timer: RequestTimer) -> dict[str, str]:
        headers = breakdown_headers(timer)
        if timer.prefill_done is not None and timer.prefill_sent is not None:
            headers["X-Pdserve-Prefill-Ms"] = f"{(timer.prefill_done - timer.prefill_sent) * 1e3:.3f}"
        overhead = proxy_overhead(timer, self.clock())
        if overhead is not None:
            headers["X-Pdserve-Proxy-Overhead-Ms"] = f"{overhead * 1e3:.3f}"
        return headers


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


def _server_timings(body: bytes) -> dict[str, Any] | None:
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


OPEN_STREAM: Any = (web.RequestKey("open_stream", SSEStream)
                    if hasattr(web, "RequestKey") else "pdserve_open_stream")


async def _open_stream(request: web.Request, out: web.StreamResponse,
                       bound: WriteBound) -> SSEStream:
    """Send the client stream's headers, and record it on the request: from then on an error
    can only end it (``end_open_stream``), never replace it with an error response. Its
    writes give up once the client took no bytes for ``bound.timeout_s``."""
    await out.prepare(request)
    stream = SSEStream(request, out, bound)
    request[OPEN_STREAM] = stream
    return stream


async def end_open_stream(request: web.Request, exc: BaseException) -> web.StreamResponse | None:
    """End the request's open client stream with an SSE error event for ``exc``; None when
    no stream was opened (the caller answers with an error status instead)."""
    stream = request.get(OPEN_STREAM)
    if stream is None:
        return None
    return await _end_stream(stream, exc)


async def _end_stream(stream: SSEStream, err: BaseException) -> web.StreamResponse:
    """End a client stream whose bytes went out with an SSE error event (the upstream, or
    the proxy itself, failed before sending its own); a blank line first closes any event
    left half-written."""
    logger.warning("stream ended with an error after the first token: %s", err)
    try:
        await stream.write(b"\n\n" + sse_error_event(err))
        await stream.write_eof()
    except (ConnectionResetError, RuntimeError):  # the client left, or the stream had ended
        pass
    return stream.response


async def _abort(*tasks: asyncio.Task[Any]) -> None:
    """Cancel unfinished legs and close responses nobody consumed, closing their connections."""
    for task in tasks:
        if not task.done():
            task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for result in results:
        if isinstance(result, aiohttp.ClientResponse):
            result.close()  # no-op when already released after a complete read
