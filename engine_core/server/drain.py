"""Draining a server for shutdown: the requests in flight finish, then the KV is released.

``drain`` runs after the server stopped taking new requests (``Readiness.draining``) and its
worker deregistered from the proxy. A request is in flight from the moment its handler was
admitted (``Readiness.admitted``: its body may still be read or tokenized) until its handler
returned, and while the engine runs it; past the drain's deadline the requests still in
flight end with an error, later ones start nothing, and the engine stops with whatever KV it
still holds (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from engine_core.engine_client import AsyncEngineClient
from engine_core.errors import EngineDeadError
from engine_core.server.readiness import Readiness

logger = logging.getLogger("pdserve.server")

STATS_TIMEOUT_S = 1.0  # one stats poll of the engine while waiting for its KV to be freed


def _num_in_flight(client: AsyncEngineClient, readiness: Readiness) -> int:
    """Requests the server took and has not answered: admitted handlers, or engine requests
    (a handler runs one per sample)."""
    return max(readiness.admitted, client.num_in_flight)


async def drain(client: AsyncEngineClient, readiness: Readiness, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the requests in flight, then end the rest with an error
    (their handlers answer it: an error event and [DONE] on a stream); then, within the same
    deadline, for the engine to hold no KV blocks (a prefill worker's sends to decode
    workers complete, or their leases end)."""
    deadline = time.monotonic() + timeout_s
    if in_flight := _num_in_flight(client, readiness):
        logger.info("Waiting up to %.0f s for %d requests in flight", timeout_s, in_flight)
    while _num_in_flight(client, readiness) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if in_flight := _num_in_flight(client, readiness):
        logger.warning("Ending %d requests still in flight: the server is shutting down",
                       in_flight)
        client.fail_in_flight(EngineDeadError("the server is shutting down"))
        await asyncio.sleep(0.5)  # let their handlers write the error out
    if client.is_alive:
        await _wait_kv_released(client, deadline)


async def _wait_kv_released(client: AsyncEngineClient, deadline: float) -> None:
    """Poll the engine until every KV block it started with is free again, or ``deadline``;
    log which it was."""
    initial_free = client.info.num_free_blocks
    held = None
    while True:
        with contextlib.suppress(Exception):  # an engine busy past the timeout: poll again
            stats = await client.get_stats(timeout_s=STATS_TIMEOUT_S)
            held = max(initial_free - stats.num_free_blocks, 0)
        if held == 0 or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    if held == 0:
        logger.info("Drained: no request in flight, every KV block free")
    else:
        logger.warning("Stopping with %s KV blocks still held (shutdown timeout reached)",
                       "unknown" if held is None else held)
