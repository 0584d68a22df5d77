"""A prefill worker SIGKILLed with requests in flight (real processes, 2P1D on CPU).

Prefill 0's engine is frozen (SIGSTOP) while a mixed batch goes out, so a known share of the
batch is inside it when the whole worker is SIGKILLed; a second batch follows at once, while
the dead worker is still registered. Every request must then either complete with the same
greedy text as before the kill (retried on prefill 1, or decode-only) or fail with a clear
error, within its deadline: none hangs, none is a 200 with an empty body, and a stream that
sent bytes ends with an SSE error event or [DONE], never silently. Afterwards the surviving
workers hold no KV block, request or transfer buffer.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from tests.integration.cluster_harness import (
    Cluster,
    Outcome,
    Req,
    build_tiny_checkpoint,
    check_usage,
    idle_violations,
    mixed_requests,
    run_all,
    scrape,
    send_all,
    wait_idle,
)

HEARTBEAT_S = 1.0
EXPIRY_S = 3.0
DEADLINE_S = 60.0        # per request, client side
TRANSFER_TIMEOUT_S = 10  # D's wait for KV from a prefill worker that died after answering
MIN_IN_FLIGHT = 4        # prefill 0 legs in flight when it is killed


def _judge(req: Req, out: Outcome, ref: Outcome) -> str | None:
    """Why ``out`` breaks the failure rules, or None when it is acceptable."""
    if out.exception is not None:
        return f"client saw {out.exception} after {out.elapsed:.1f}s"
    if out.elapsed > DEADLINE_S:
        return f"took {out.elapsed:.1f}s"
    if out.status != 200:
        if out.status not in (502, 503, 504) or not out.error:
            return f"status {out.status} without a clear error: {out.body[:200]!r}"
        return None
    if not req.stream and not out.body:
        return "HTTP 200 with an empty body"
    if out.error is not None:  # a stream ended by an SSE error event: acceptable
        return None if req.stream and out.done else f"error {out.error!r} in a 200"
    if out.text != ref.text:
        return f"text {out.text!r} != {ref.text!r}"
    check_usage(req, out, ref)
    return None


async def _batch_during_kill(cluster: Cluster, reqs: list[Req], prefill0_address: str
                             ) -> tuple[list[Outcome], int]:
    """Send ``reqs`` with prefill 0 frozen; kill it once enough legs are inside it."""
    loop = asyncio.get_running_loop()
    prefill0 = cluster.worker("prefill0")
    cluster.signal_engine(prefill0, signal.SIGSTOP)
    first = asyncio.create_task(send_all(cluster.url, reqs, timeout_s=DEADLINE_S))
    started, in_flight = time.monotonic(), 0
    while in_flight < MIN_IN_FLIGHT:
        assert time.monotonic() - started < 30, "requests never reached prefill 0"
        await asyncio.sleep(0.1)
        workers = await loop.run_in_executor(None, cluster.instances)
        in_flight = next(w["in_flight"] for w in workers if w["http_address"] == prefill0_address)
    await asyncio.sleep(0.3)  # let the rest of the batch arrive
    workers = await loop.run_in_executor(None, cluster.instances)
    in_flight = next(w["in_flight"] for w in workers if w["http_address"] == prefill0_address)
    await loop.run_in_executor(None, cluster.kill, prefill0)
    # At once, while prefill 0 is still registered: these meet a refused connection.
    second = asyncio.create_task(send_all(cluster.url, reqs, timeout_s=DEADLINE_S))
    return [*await first, *await second], in_flight


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prefill_killed_with_requests_in_flight(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_prefill=2, num_decode=1,
                            heartbeat_s=HEARTBEAT_S, heartbeat_timeout_s=EXPIRY_S,
                            kv_extra={"transfer_timeout_s": TRANSFER_TIMEOUT_S})
    prefill0, prefill1, decode0 = cluster.workers
    reqs = mixed_requests(24)
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        cluster.wait_ready([cluster.proxy, *cluster.workers])
        want = run_all(cluster.url, reqs)
        assert all(o.ok for o in want), want

        got, in_flight = asyncio.run(_batch_during_kill(cluster, reqs, prefill0.http_address))
        assert in_flight >= MIN_IN_FLIGHT, in_flight
        broken = [(req.path, req.body, why) for req, out, ref in zip(reqs * 2, got, want * 2)
                  if (why := _judge(req, out, ref)) is not None]
        assert not broken, f"{len(broken)} requests broke the rules: {broken[:5]}\n" \
            + cluster.logs()
        # The retry path exists, so every request in flight on prefill 0 is served elsewhere.
        failed = [o for o in got if not o.ok]
        assert not failed, failed[:5]
        retries = scrape(cluster.url.removeprefix("http://")).get("pdserve:proxy_retries_total")
        assert retries is not None and retries >= in_flight, (retries, in_flight)

        # The dead prefill worker leaves; the survivors are idle and keep serving.
        deadline = time.monotonic() + EXPIRY_S + 10
        while prefill0.http_address in cluster.registered():
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.2)
        survivors = [prefill1.http_address, decode0.http_address]
        scraped = wait_idle(survivors, TRANSFER_TIMEOUT_S + 20)
        assert not idle_violations(scraped), idle_violations(scraped)
        after = run_all(cluster.url, reqs)
        assert all(o.ok and o.text == r.text for o, r in zip(after, want)), after
    finally:
        cluster.stop()
