"""The proxy's aiohttp application factory.

State lives on the app under the AppKeys of ``proxy.keys``; the upstream ClientSession (and
the ``Dispatcher`` that uses it), the heartbeat-expiry task and the registration server
are started and stopped by ``cleanup_ctx`` entries, so a test server gets exactly the
same lifecycle as ``pdserve proxy``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from engine_core.cluster.grants import GrantAuthority
from engine_core.server.api_key import api_key_middleware
from engine_core.server.http_errors import error_middleware
from engine_core.server.json_parser import JsonParser
from engine_core.server.loop_watch import LoopWatch
from proxy import keys
from proxy.config import ProxyConfig
from proxy.dispatcher import Dispatcher
from proxy.forwarding import LegTimeouts, create_upstream_session
from proxy.handlers import add_routes
from proxy.kv_release import KVReleaser
from proxy.legs import InflightLimiter
from proxy.metrics import ProxyMetrics
from proxy.model_cards import ModelCards
from proxy.placer import Placer
from proxy.registration import RegistrationServer
from proxy.registry import Clock, InstanceRegistry
from proxy.routing import make_policy

logger = logging.getLogger(__name__)


# The proxy's admin routes: they need the API key always (engine_core/server/api_key.py).
ADMIN_ROUTES = ("/instances",)


def new_request_id() -> str:
    """A fresh unique id (32 hex characters)."""
    return uuid.uuid4().hex


def create_app(config: ProxyConfig, *, clock: Clock = time.monotonic,
               id_factory: Callable[[], str] = new_request_id,
               registry: InstanceRegistry | None = None) -> web.Application:
    """Build the proxy app; ``registry`` may be pre-filled (tests) or is created empty."""
    app = web.Application(client_max_size=config.max_body_bytes + 1,
                          middlewares=[error_middleware,
                                       api_key_middleware(config.api_key, ADMIN_ROUTES)])
    registry = registry or InstanceRegistry(config.heartbeat_timeout_s, config.suspect_s, clock,
                                            max_workers=config.max_workers)
    app[keys.CONFIG] = config
    app[keys.CLOCK] = clock
    app[keys.ID_FACTORY] = id_factory
    app[keys.REGISTRY] = registry
    app[keys.POLICY] = make_policy(config.routing, config.affinity_max_imbalance)
    app[keys.LIMITER] = InflightLimiter(config.max_inflight)
    app[keys.MODEL_CARDS] = ModelCards()
    app[keys.PLACER] = placer = Placer(config.placement)
    app[keys.JSON_PARSER] = JsonParser()
    registry.add_removal_listener(placer.forget)
    server = None
    if config.registration_port is not None:
        server = RegistrationServer(registry, config.registration_bind_host,
                                    config.registration_port, secret=config.cluster_secret)
        app[keys.REGISTRATION_SERVER] = server
        app.cleanup_ctx.append(_registration_ctx)
    app[keys.METRICS] = ProxyMetrics(registry, (lambda: server.stats) if server else (lambda: (0, 0)),
                                     (lambda: server.refusals) if server else dict)
    app.cleanup_ctx.append(_upstream_ctx)
    app.cleanup_ctx.append(_expiry_ctx)
    app.cleanup_ctx.append(_loop_watch_ctx)
    app.cleanup_ctx.append(_json_parser_ctx)
    add_routes(app)
    return app


async def _loop_watch_ctx(app: web.Application) -> AsyncIterator[None]:
    """A stalled proxy loop reads no heartbeats: say so, with the stack it was stuck in."""
    watch = LoopWatch("proxy", on_stall=app[keys.METRICS].observe_loop_stall)
    await watch.start()
    yield
    await watch.stop()


async def _json_parser_ctx(app: web.Application) -> AsyncIterator[None]:
    """Large request bodies are parsed off the loop, in the parser's child process."""
    yield
    await app[keys.JSON_PARSER].close()


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[keys.CONFIG]
    session = create_upstream_session(config.api_key)
    app[keys.DISPATCHER] = dispatcher = Dispatcher(
        registry=app[keys.REGISTRY], policy=app[keys.POLICY], metrics=app[keys.METRICS],
        session=session, clock=app[keys.CLOCK], max_attempts=config.max_attempts,
        max_response_bytes=config.max_response_bytes, write_timeout_s=config.write_timeout_s,
        affinity_prefix_chars=config.affinity_prefix_chars,
        first_token_from_prefill=config.first_token_from_prefill,
        prefill_overflow=config.prefill_overflow, limiter=app[keys.LIMITER],
        placer=app[keys.PLACER], migration_limit=config.migration_limit,
        grants=GrantAuthority(config.cluster_secret),
        releaser=KVReleaser(config.cluster_secret, config.connect_timeout_s),
        timeouts=LegTimeouts(prefill_s=config.prefill_timeout_s,
                             decode_s=config.decode_timeout_s,
                             connect_s=config.connect_timeout_s,
                             first_byte_s=config.first_byte_deadline_s,
                             stall_s=config.stall_timeout_s))
    yield
    await dispatcher.aclose()
    await session.close()


async def expiry_loop(registry: InstanceRegistry, period_s: float) -> None:
    """Drop workers that missed their heartbeats, every ``period_s``; a round that wakes late
    (the proxy's own loop was held) is skipped: the heartbeats of that time may still wait
    unread in the registration socket, and the next round comes after they are read."""
    while True:
        asked = time.monotonic()
        await asyncio.sleep(period_s)
        if time.monotonic() - asked > 2 * period_s:
            logger.warning("expiry round %.2f s late (the proxy's loop was held); skipped",
                           time.monotonic() - asked - period_s)
            continue
        for worker_id in registry.expire():
            logger.warning("worker %s missed its heartbeats for %.1fs: dropped", worker_id,
                           registry.heartbeat_timeout_s)


async def _expiry_ctx(app: web.Application) -> AsyncIterator[None]:
    registry = app[keys.REGISTRY]
    period_s = min(1.0, registry.heartbeat_timeout_s / 4)
    task = asyncio.create_task(expiry_loop(registry, period_s), name="proxy-expiry")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _registration_ctx(app: web.Application) -> AsyncIterator[None]:
    server = app[keys.REGISTRATION_SERVER]
    await server.start()
    yield
    await server.stop()
