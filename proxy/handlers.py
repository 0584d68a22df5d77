"""HTTP routes of the proxy: OpenAI endpoints, /v1/models, /tokenize, /detokenize, /version,
/health (and /ping), /ready, /metrics, /instances, and the admin call that changes a
worker's capabilities (POST /instances/capabilities)."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engine_core.cluster.messages import CAPABILITIES, ROLES
from engine_core.errors import (
    InvalidRequestError,
    OverloadedError,
    PdserveError,
    RequestTooLargeError,
)
from engine_core.server.http_errors import error_response
from engine_core.server.request_body import read_json_body
from engine_core.version import package_version
from proxy import keys
from proxy.client_stream import end_open_stream
from proxy.forwarding import FORWARDED_HEADERS
from proxy.legs import RequestTimer, proxy_overhead
from proxy.metrics import ProxyMetrics
from proxy.model_cards import ModelCard

logger = logging.getLogger(__name__)

_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9._:-]")
MAX_CLIENT_ID_CHARS = 64
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away (metrics only)


def make_transfer_id(client_request_id: str | None, new_id: Callable[[], str]) -> str:
    """The request's transfer id: the client's X-Request-Id (sanitized) as base, made unique."""
    unique = new_id()
    if client_request_id:
        base = _UNSAFE_ID_CHARS.sub("_", client_request_id.strip())[:MAX_CLIENT_ID_CHARS]
        if base:
            return f"{base}-{unique}"
    return unique


async def read_json_object(request: web.Request, max_bytes: int, timeout_s: float) -> dict:
    """The request body as a JSON object, at most ``max_bytes``, all of it within
    ``timeout_s``: it is read under an admission slot, which a client that sends slowly or
    stops mid-body would otherwise hold for good. The worker validates the rest."""
    body = await read_json_body(request, max_bytes, timeout_s, request.app[keys.JSON_PARSER])
    check_finite_numbers(body)
    return body


def check_finite_numbers(body: dict[str, Any]) -> None:
    """Refuse a number no JSON can carry on: a literal past the double range (1e400)
    parses as infinity, and sent on to a worker it became ``Infinity``, which the worker
    could only call a body that is not JSON. The parameter holding it is named (the
    top-level one for a nested value). Walked without recursion: the body may nest as deep
    as the parser allowed."""
    stack: list[tuple[str, Any, bool]] = [(key, value, True) for key, value in body.items()]
    while stack:
        param, value, top = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequestError(f"{param} must be a finite number" if top else
                                      f"{param} must hold only finite numbers", param)
        if isinstance(value, dict):
            stack.extend((param, item, False) for item in value.values())
        elif isinstance(value, list):
            stack.extend((param, item, False) for item in value)


def _error_response(exc: BaseException, request_id: str) -> web.Response:
    return error_response(exc, headers={"X-Request-Id": request_id})


_REJECT_REASONS = {413: "too_large", 408: "body_timeout", 429: "overloaded", 400: "invalid",
                   404: "model_not_found", 503: "no_worker"}


async def _serve(request: web.Request, path: str, generates: bool = True) -> web.StreamResponse:
    app = request.app
    clock, metrics, limiter = app[keys.CLOCK], app[keys.METRICS], app[keys.LIMITER]
    timer = RequestTimer(arrival=clock())
    transfer_id = make_transfer_id(request.headers.get("X-Request-Id"), app[keys.ID_FACTORY])
    status = 500
    acquired = False
    try:
        config = app[keys.CONFIG]
        if request.content_length is not None and request.content_length > config.max_body_bytes:
            raise RequestTooLargeError(f"request body of {request.content_length} bytes exceeds "
                                       f"the limit of {config.max_body_bytes} bytes")
        if not limiter.try_acquire():
            raise OverloadedError(f"too many requests in flight (limit {limiter.limit}); "
                                  "retry later")
        acquired = True
        metrics.in_flight.inc()
        body = await read_json_object(request, config.max_body_bytes, config.body_timeout_s)
        response = await app[keys.DISPATCHER].dispatch(request, path, body, transfer_id, timer,
                                                       generates)
        status = response.status
        return response
    except PdserveError as exc:
        opened = await end_open_stream(request, exc)
        if opened is not None:  # after the first byte the stream can only end with an event
            return opened
        response = _error_response(exc, transfer_id)
        status = response.status
        if status in _REJECT_REASONS and timer.dispatched is None:
            metrics.rejected.labels(_REJECT_REASONS[status]).inc()
        return response
    except asyncio.CancelledError:
        status = CLIENT_CLOSED_REQUEST
        raise
    except Exception as exc:  # a proxy bug must still answer with an error body
        logger.exception("request %s failed inside the proxy", transfer_id)
        return await end_open_stream(request, exc) or _error_response(exc, transfer_id)
    finally:
        if acquired:
            limiter.release()
            metrics.in_flight.dec()
        metrics.requests.labels(path, str(status)).inc()
        _observe_timings(metrics, timer, clock())


def _observe_timings(metrics: ProxyMetrics, timer: RequestTimer, now: float) -> None:
    if timer.dispatched is None or timer.mode is None:
        return
    mode = timer.mode
    metrics.queue_time.observe(timer.dispatched - timer.arrival)
    if timer.prefill_done is not None and timer.prefill_sent is not None:
        metrics.prefill_leg.observe(timer.prefill_done - timer.prefill_sent)
    if timer.first_byte is not None:
        metrics.time_to_first_byte.labels(mode).observe(timer.first_byte - timer.arrival)
    metrics.request_time.labels(mode).observe(now - timer.arrival)
    overhead = proxy_overhead(timer, now)
    if overhead is not None:
        metrics.overhead.labels(mode).observe(overhead)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _serve(request, "/v1/completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _serve(request, "/v1/chat/completions")


async def tokenize(request: web.Request) -> web.StreamResponse:
    """POST /tokenize: answered by a decode or colocated worker of the model."""
    return await _serve(request, "/tokenize", generates=False)


async def detokenize(request: web.Request) -> web.StreamResponse:
    """POST /detokenize: answered by a decode or colocated worker of the model."""
    return await _serve(request, "/detokenize", generates=False)


async def version(request: web.Request) -> web.Response:
    """GET /version: the proxy's pdserve version (workers report theirs in /instances)."""
    return web.json_response({"version": package_version()})


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the models the registered workers can answer for (a model whose
    decode workers are all gone is not listed: its requests would get a 503), each with
    the ``root``, ``parent`` and ``max_model_len`` of its workers' own cards."""
    app = request.app
    registry = app[keys.REGISTRY]
    servable = registry.servable_models()
    headers = {n: request.headers[n] for n in FORWARDED_HEADERS if n in request.headers}
    cards = await app[keys.MODEL_CARDS].cards(
        app[keys.DISPATCHER].session,
        [w for w in registry.workers() if w.model in servable], headers)
    created = int(time.time())
    data = [{"id": model, "object": "model", "created": created, "owned_by": "pdserve",
             **cards.get(model, ModelCard()).fields()} for model in servable]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """GET /health (and /ping, by GET or POST: SageMaker's name for it, as vLLM serves
    it): the proxy is up (200 even with no workers; see /instances for those)."""
    registry = request.app[keys.REGISTRY]
    counts = {role: len(registry.workers(role)) for role in ROLES}
    return web.json_response({"status": "ok", "workers": counts})


async def ready(request: web.Request) -> web.Response:
    """GET /ready: readiness, for a load balancer or a Kubernetes readiness probe. 200 when
    at least one model can be answered now (a decode or colocated worker registered), else
    503, so traffic leaves a proxy whose workers are all gone while /health
    (liveness) stays 200 and the process is not restarted for it."""
    registry = request.app[keys.REGISTRY]
    servable = registry.servable_models()
    counts = {role: len(registry.workers(role)) for role in ROLES}
    body = {"status": "ready" if servable else "not_ready", "models": servable,
            "workers": counts}
    return web.json_response(body, status=200 if servable else 503)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text."""
    body = request.app[keys.METRICS].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def instances(request: web.Request) -> web.Response:
    """GET /instances: registered workers and their state."""
    app = request.app
    return web.json_response({
        "heartbeat_timeout_s": app[keys.REGISTRY].heartbeat_timeout_s,
        "routing": app[keys.POLICY].name,
        "in_flight": app[keys.LIMITER].count,
        "workers": app[keys.REGISTRY].snapshot(),
        "lanes": app[keys.PLACER].planner.describe(),
    })


async def set_capabilities(request: web.Request) -> web.Response:
    """POST /instances/capabilities ``{"worker": "host:port", "capabilities": [...] | null}``:
    what the proxy places on a worker from the next request on (null: all it announces);
    legs in flight finish where they are, so no request is lost. Answers the worker's
    /instances entry."""
    try:
        return _set_capabilities(request.app, await read_json_object(
            request, 64 << 10, request.app[keys.CONFIG].body_timeout_s))
    except PdserveError as exc:
        return error_response(exc, "")


def _set_capabilities(app: web.Application, body: dict[str, Any]) -> web.Response:
    worker, capabilities = body.get("worker"), body.get("capabilities")
    if not isinstance(worker, str):
        raise InvalidRequestError("worker must be a worker's http_address (see /instances)",
                                  "worker")
    if capabilities is not None and not (
            isinstance(capabilities, list) and set(capabilities) <= set(CAPABILITIES)
            and all(isinstance(c, str) for c in capabilities)):
        raise InvalidRequestError(f"capabilities must be null or a list of {CAPABILITIES}",
                                  "capabilities")
    registry = app[keys.REGISTRY]
    if not registry.restrict(worker, None if capabilities is None else frozenset(capabilities)):
        return error_response(web.HTTPNotFound(text=f"no worker {worker[:100]!r} is registered"))
    state = registry.get(worker)
    assert state is not None
    logger.info("worker %s: capabilities now %s", worker, sorted(state.capabilities))
    return web.json_response(state.to_json(app[keys.CLOCK]()))


def add_routes(app: web.Application) -> None:
    """Register every route on the app."""
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/ready", ready)
    app.router.add_post("/ping", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/instances", instances)
    app.router.add_post("/instances/capabilities", set_capabilities)
