"""Draining a server for shutdown: the requests in flight finish, then the KV is released.

``drain`` runs after the server stopped taking new requests (``Readiness.draining``) and its
worker deregistered from the proxy; past its deadline the requests still in flight end with
an error and the engine stops with whatever KV it still holds (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from engine_core.engine_client import AsyncEngineClient
from engine_core.errors import EngineDeadError

logger = logging.getLogger("pdserve.server")

STATS_TIMEOUT_S = 1.0  # one stats poll of the engine while waiting for its KV to be freed


async def drain(client: AsyncEngineClient, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the requests in flight, then end the rest with an error
    (their handlers answer it: an error event and [DONE] on a stream); then, within the same
    deadline, for the engine to hold no KV blocks (a prefill worker's sends to decode
    workers complete, or their leases end)."""
    deadline = time.monotonic() + timeout_s
    if client.num_in_flight:
        logger.info("Waiting up to %.0f s for %d requests in flight", timeout_s,
                    client.num_in_flight)
    while client.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if client.num_in_flight:
        logger.warning("Ending %d requests still in flight: the server is shutting down",
                       client.num_in_flight)
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
