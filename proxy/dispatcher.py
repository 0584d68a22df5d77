"""Dispatcher: one client request -> route -> legs -> the client's response.

The route comes from ``routing.plan_route``: the placement policy's (``proxy/placer.py``)
when workers with capabilities serve the model (``local``: one leg, the whole request on
one worker; ``pd``: prefill on one, decode on another), else the static P/D/colocated rules.

Disaggregated attempt: both legs leave at once (a request asking for prompt logprobs: D's
after P answered, carrying them, ``proxy/prompt_logprobs.py``); P's answer (one token, no stream) is awaited
first while D's early refusal is watched; then D's answer is relayed. Failure rules:

- P fails (connect, disconnect, timeout, 5xx) before any byte reached the client: D's leg
  is aborted and the request is tried again without that P, which becomes decode-only on
  D when no other P is left (``routing.plan_route``). Each retry gets the transfer id
  ``T-retryN`` so a late KV transfer of an aborted attempt can never match the new one.
- D (or a colocated worker) cannot be connected to: tried again without it.
- A worker's 4xx is forwarded unchanged; D's 503 (asleep, not ready) before any byte went
  out is tried again without that worker (the heartbeat that says it sleeps may still be on
  its way); D's other 5xx, a reset, a stream's missed first-byte deadline, its worker
  leaving the registry or an empty answer before any byte went out migrates the request
  (``proxy/migration.py``: another worker, up to ``--migration-limit`` times), and when
  none is left it is a 502/504 with an OpenAI error body, never a 200 with an empty body.
- After bytes went out, a failed stream is continued on another worker after the tokens
  the client holds (``proxy/migration.py``); one that cannot be ends with an SSE
  ``data: {"error": ...}`` event and ``data: [DONE]``.
- Cancellation (client gone; the server runs with handler cancellation) closes every leg.
- KV that P computed for a D that will never pull it is released at once (``_release``:
  the proxy tells P's KV control sockets itself, ``proxy/kv_release.py``), not left to P's
  lease: D refused the request (a 4xx) or failed (unreachable, a 503, a 5xx, no answer in
  time) after P computed it, or while P still ran it (P's leg is then awaited in the
  background, ``_settle_prefill``, not cut); or the client left before any D took the
  request (P's leg cut; in a handoff ``_settle_decode`` learns from D's answer whether D
  took it). P's own request is the
  client's (``forwarding.producer_body``), validated there as D validates it, so what D
  refuses P refuses first in the common case, computing nothing.
- A streaming client that takes no bytes for ``write_timeout_s`` (it stopped reading) has
  its connection aborted (``engine_core.server.streaming.SSEStream``), which then ends as a
  client that left does.

First-token handoff (default; ``--no-first-token-from-prefill``): ``proxy/handoff.py``. Legs and their
book-keeping: ``proxy/legs.py``; the client's open stream: ``proxy/client_stream.py``; a
worker's answer relayed to the client: ``proxy/relay.py``; settles and releases in the
background: ``proxy/background.py``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import aiohttp
from aiohttp import web

from engine_core.cluster.grants import GrantAuthority
from engine_core.cluster.trust import ClusterSecret
from engine_core.errors import (
    ConfigError,
    NoWorkerError,
    UpstreamError,
    UpstreamTimeoutError,
)
from proxy import forwarding as fw
from proxy.background import BackgroundWork
from proxy.handoff import FirstTokenHandoff
from proxy.kv_release import KVReleaser
from proxy.legs import (
    HeldKV,
    InflightLimiter,
    Leg,
    RequestTimer,
    Retry,
    abort_tasks,
    server_timings,
)
from proxy.metrics import ProxyMetrics
from proxy.migration import RESUME, LegWatch, Migrate, Resume, StreamMigration, continuable, within
from proxy.placer import Placer
from proxy.prefix_index import PromptShape, prompt_shape
from proxy.prompt_logprobs import from_prefill_answer, wants_prompt_logprobs, with_prompt_logprobs
from proxy.registry import Clock, InstanceRegistry, WorkerState
from proxy.relay import ClientRelay
from proxy.routing import MODE_PD, Route, RoutingPolicy, plan_route

logger = logging.getLogger(__name__)


class Dispatcher(BackgroundWork, FirstTokenHandoff, StreamMigration, ClientRelay):
    """Routes requests and runs their legs; holds no per-request state between calls."""

    def __init__(self, *, registry: InstanceRegistry, policy: RoutingPolicy,
                 metrics: ProxyMetrics, session: aiohttp.ClientSession, timeouts: fw.LegTimeouts,
                 clock: Clock, max_attempts: int = 3, max_response_bytes: int = 64 << 20,
                 affinity_prefix_chars: int = 256, first_token_from_prefill: bool = True,
                 prefill_overflow: int = 0, write_timeout_s: float = 60.0,
                 limiter: InflightLimiter | None = None, placer: Placer | None = None,
                 migration_limit: int = 3, grants: GrantAuthority | None = None,
                 releaser: KVReleaser | None = None) -> None:
        self.registry = registry
        self.placer = placer
        # Signs each request's transfer grant (P, D, transfer id), attached to both legs.
        self.grants = grants or GrantAuthority(ClusterSecret())
        # Tells P to drop KV no decode leg will pull (over P's KV control sockets).
        self.releaser = releaser or KVReleaser(ClusterSecret())
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
        self.migration_limit = migration_limit
        self.leg_watch = LegWatch()
        registry.add_expiry_listener(self.leg_watch.worker_removed)
        # Work that outlives its client request: settling a leg whose outcome decides
        # whether P must drop KV, and the releases themselves (``aclose`` ends them).
        self._background: set[asyncio.Task[None]] = set()
        self._pending_releases = 0  # releases waiting or being sent (``_spawn_release``)
        # Each settle holds a slot of the client requests' limiter (--max-inflight) while it
        # runs: a leg left running is load on its worker like a client's request.
        self.limiter = limiter or InflightLimiter(1 << 30)

    def _grant(self, transfer_id: str, prefill: WorkerState, decode: WorkerState) -> str:
        """The grant moving ``transfer_id``'s KV from ``prefill`` to ``decode``, valid while
        either leg may still run (its workers derive each rank pair's from it). Raises
        ``ConfigError`` (400) for a pair whose KV layouts cannot be mapped, before any leg
        leaves."""
        reason = fw.layout_refusal(prefill.kv_ranks, decode.kv_ranks)
        if reason is not None:
            self.metrics.layout_refusals.inc()
            raise ConfigError(f"prefill worker {prefill.worker_id} cannot send KV to decode "
                              f"worker {decode.worker_id}: {reason}")
        return self.grants.issue(transfer_id, prefill.zmq_address or prefill.worker_id,
                                 decode.zmq_address or decode.worker_id,
                                 self.timeouts.prefill_s + self.timeouts.decode_s)

    async def dispatch(self, request: web.Request, path: str, body: dict[str, Any],
                       transfer_id: str, timer: RequestTimer,
                       generates: bool = True) -> web.StreamResponse:
        """Serve one validated request body; raise a PdserveError for an error status.

        ``generates`` False (/tokenize, /detokenize): one worker that can answer it
        whole (D or colocated) gets the request, with the same retries."""
        model = body.get("model") if isinstance(body.get("model"), str) else None
        key = fw.affinity_key(path, body, self.affinity_prefix_chars)
        # Only a generating request's prompt is computed: others place as short ones.
        placer = None if self.placer is None else functools.partial(
            self.placer.route, shape=prompt_shape(path, body) if generates else PromptShape(0))
        excluded: set[str] = set()
        resume = Resume(path, body, model, key, excluded, generates and continuable(path, body))
        request[RESUME] = resume
        last_error: UpstreamError | None = None
        handoff_counted = False  # the handoff metric counts requests, not attempts
        retries = 0
        while True:
            attempt = retries + resume.migrations
            attempt_id = transfer_id if attempt == 0 else f"{transfer_id}-retry{attempt}"
            try:
                route = plan_route(self.registry, self.policy, model, excluded, key,
                                   self.prefill_overflow if generates else 0, placer)
            except NoWorkerError:
                if last_error is not None:
                    raise last_error from None
                raise
            self.metrics.routing_decisions.labels(
                route.mode, route.prefill.worker_id if route.prefill else "",
                route.decode.worker_id).inc()
            if route.placement is not None and generates:
                self._count_placement(route)
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
                                               route.decode, route.mode, attempt_id, timer,
                                               route.prefill_tokens)
            except Retry as retry:
                logger.warning("request %s: %s failed (%s); retrying without %s", attempt_id,
                               route.describe(), retry.error, retry.worker.worker_id)
                excluded.add(retry.worker.worker_id)
                last_error = retry.error
                if isinstance(retry, Migrate):
                    if not self.count_migration(resume, retry.error.kind):
                        raise retry.error from None
                    continue
                self.metrics.retries.labels(retry.reason).inc()
                retries += 1
                if retries >= self.max_attempts:
                    raise retry.error from None

    def _count_placement(self, route: Route) -> None:
        """The placement's metrics: the decision, and the predicted time of its prefill."""
        placement = route.placement
        assert placement is not None
        self.metrics.placements.labels(placement.placement, placement.reason).inc()
        if route.prefill_tokens:
            self.metrics.prefill_predicted.labels(placement.prefill or placement.decode).observe(
                placement.predicted_prefill_s)

    async def _run_pd(self, request: web.Request, path: str, body: dict[str, Any], route: Route,
                      attempt_id: str, timer: RequestTimer) -> web.StreamResponse:
        prefill, decode = route.prefill, route.decode
        assert prefill is not None and prefill.zmq_address and decode.zmq_address
        headers = fw.leg_headers(request.headers, attempt_id)
        grant = self._grant(attempt_id, prefill, decode)
        held = HeldKV(prefill, decode, fw.prompt_transfer_ids(path, body, attempt_id), grant)
        p_leg = Leg(self, prefill, "prefill", route.prefill_tokens)
        d_leg = Leg(self, decode, "decode")
        timer.prefill_sent = self.clock()
        p_task = asyncio.create_task(self._prefill(
            prefill.url + path, fw.prefill_body(body, attempt_id, decode.zmq_address, grant,
                                                decode.kv_ranks),
            headers))
        d_body = fw.decode_body(body, attempt_id, prefill.zmq_address, grant,
                                prefill_ranks=prefill.kv_ranks)

        def open_decode(answer: bytes | None = None) -> asyncio.Task[aiohttp.ClientResponse]:
            leg_body = d_body if answer is None else with_prompt_logprobs(
                d_body, from_prefill_answer(answer))
            return asyncio.create_task(fw.open_leg(self.session, decode.url + path, leg_body,
                                                   headers, self.timeouts.decode()))

        # D's leg leaves with P's unless it must carry P's prompt logprobs (after P).
        d_task = None if wants_prompt_logprobs(path, body) else open_decode()
        p_settling = False  # P's leg handed to ``_settle_prefill``
        handled = False  # P's KV settled or released: done once per attempt
        d_took = False  # D answered 2xx: its engine runs the request, its connector frees

        def settle() -> None:
            """D refused or failed while P computes: P's leg is settled, not cut (with no
            --max-inflight slot free it is cut and P told at once)."""
            nonlocal p_settling, handled
            if not handled:
                handled = True
                p_settling = self._spawn(self._settle_prefill(p_task, p_leg, held))
                if not p_settling:
                    self._spawn_release(held)

        def release() -> None:
            """No decode leg will pull P's KV (D refused or failed, the client left)."""
            nonlocal handled
            if not handled and not d_took:
                handled = True
                self._spawn_release(held)

        try:
            pending: set[asyncio.Task[Any]] = {p_task} if d_task is None else {p_task, d_task}
            while not p_task.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if d_task is not None and d_task in done and not p_task.done():
                    try:
                        d_response = await self._decode_response(d_task, d_leg)
                        if not 200 <= d_response.status < 300:  # its answer stands
                            settle()
                            return await self._forward_refusal(d_response, d_leg, attempt_id)
                    except Retry:
                        settle()
                        raise
            verdict = self._prefill_verdict(p_task, p_leg, attempt_id, timer)
            if isinstance(verdict, web.Response):
                return verdict
            if d_task is None:
                d_task = open_decode(verdict)
            try:
                d_response = await self._decode_response(d_task, d_leg,
                                                         body.get("stream") is True)
                if not 200 <= d_response.status < 300:
                    release()  # before its body is read, which may fail or be cut
                    return await self._forward_refusal(d_response, d_leg, attempt_id)
                d_took = True
                return await self._relay(request, d_response, d_leg, attempt_id, timer)
            except Retry:
                # D failed before it answered (unreachable, asleep, dead, silent): the next
                # attempt moves the prompt under a new transfer id, so P's is dropped now.
                release()
                raise
        except asyncio.CancelledError:
            # The client left: P's leg is cut (an abort landing after P's save would leave
            # the KV held), and a D leg that had not started its request pulls nothing.
            release()
            raise
        finally:
            d_leg.finish(aborted=True)
            opened = [] if d_task is None else [d_task]
            if p_settling:
                await abort_tasks(*opened)
            else:
                p_leg.finish(aborted=True)
                await abort_tasks(p_task, *opened)

    def _prefill_verdict(self, p_task: asyncio.Task[tuple[int, str, bytes]], p_leg: Leg,
                         attempt_id: str, timer: RequestTimer) -> bytes | web.Response:
        """P's answer body when it succeeded; its 4xx verdict as the client's response; a
        retry without P when it failed (raises ``Retry``)."""
        try:
            p_status, p_type, p_data = p_task.result()
        except UpstreamError as err:
            p_leg.finish(err)
            raise Retry(p_leg.worker, err, f"prefill_{err.kind}") from None
        if p_status >= 500:
            err = UpstreamError(f"prefill worker {p_leg.worker.worker_id} answered {p_status}",
                                kind="status", status=p_status)
            p_leg.finish(err)
            raise Retry(p_leg.worker, err, "prefill_status")
        p_leg.prefill_done(measured=p_status < 300)
        p_leg.finish()
        if p_status >= 300:  # the worker judged the request: pass its verdict on
            return web.Response(status=p_status, body=p_data, content_type=p_type,
                                headers={"X-Request-Id": attempt_id})
        timer.prefill_done = self.clock()
        timer.prefill_timings = server_timings(p_data)
        return p_data

    async def _run_one_leg(self, request: web.Request, path: str, leg_body: dict[str, Any],
                           worker: WorkerState, role: str, attempt_id: str,
                           timer: RequestTimer, prefill_tokens: int = 0) -> web.StreamResponse:
        """One worker's leg relayed to the client: a colocated or decode-only request, or
        D's leg once P has answered (``role`` "decode")."""
        leg = Leg(self, worker, role, prefill_tokens)
        task = asyncio.create_task(fw.open_leg(
            self.session, worker.url + path, leg_body,
            fw.leg_headers(request.headers, attempt_id), self.timeouts.decode()))
        try:
            response = await self._decode_response(task, leg, leg_body.get("stream") is True)
            if not 200 <= response.status < 300:
                return await self._forward_refusal(response, leg, attempt_id)
            return await self._relay(request, response, leg, attempt_id, timer)
        finally:
            leg.finish(aborted=True)
            await abort_tasks(task)

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

    async def _decode_response(self, task: asyncio.Task[aiohttp.ClientResponse], leg: Leg,
                               streamed: bool = False) -> aiohttp.ClientResponse:
        """D's (or a colocated worker's) response headers, within the first-byte deadline
        for a stream (a worker sends a stream's headers with its first event); retry when
        it was unreachable, migrate when it failed, stalled or left the registry."""
        lost = self.leg_watch.watch(leg.worker.worker_id)
        try:
            return await within(task, self.timeouts.first_byte_s if streamed else None, lost,
                                f"{leg.role} worker {leg.worker.worker_id}")
        except UpstreamError as err:
            leg.finish(err)
            if err.connect_failed:
                raise Retry(leg.worker, err, f"{leg.role}_connect") from None
            raise Migrate(leg.worker, err, f"{leg.role}_{err.kind}") from None
        finally:
            self.leg_watch.forget(leg.worker.worker_id, lost)
