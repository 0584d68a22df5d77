"""Request migration and several proxies on a real CPU cluster (1P1D, two proxies).

The workers register with both proxies. Through proxy A a fake decode worker that accepts
requests and never answers (registered with A only) gets half the requests: its streams move
to the real decode worker at the first-byte deadline, its whole requests once its heartbeats
stop and A drops it; every answer equals the one proxy B gives, unbroken. Then proxy B is
SIGKILLed with streams open on both proxies: only B's streams end, A's complete and A goes
on serving, and every worker's KV gauges return to 0. (A killed decode worker's streams are
migrated in test_cluster_membership.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from aiohttp import web

from deploy.launch import CLUSTER_SECRET_FILE, Child, free_ports
from engine_core.cluster.messages import ROLE_DECODE
from engine_core.cluster.registration_client import RegistrationClient
from engine_core.cluster.trust import ClusterSecret, load_secret_file
from engine_core.version import package_version
from tests.integration.cluster_harness import (
    MODEL,
    Cluster,
    Outcome,
    Req,
    Throttle,
    build_tiny_checkpoint,
    check_matches,
    idle_violations,
    labelled_counter,
    mixed_requests,
    registered_workers,
    run_all,
    send_all,
    wait_http,
    wait_idle,
    with_limit,
)

# The silent worker is found out after this; a real one that takes over a migrated stream
# (P recomputes the prompt, D pulls it) must send its first byte within it on a loaded
# 2-core runner too.
FIRST_BYTE_S = 6.0
HEARTBEAT_TIMEOUT_S = 3.0
LONG_TOKENS = 150


class SilentWorker:
    """A decode worker that registers, takes requests and never answers them."""

    def __init__(self, registration_address: str, port: int, kv_port: int,
                 secret: ClusterSecret) -> None:
        self.received: list[dict] = []
        self._port = port
        self._registration = RegistrationClient(
            registration_address, role=ROLE_DECODE, http_address=f"127.0.0.1:{port}",
            model=MODEL, zmq_address=f"127.0.0.1:{kv_port}", version=package_version(),
            interval_s=0.5, secret=secret)
        self._runner: web.AppRunner | None = None

    async def _swallow(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.json())
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._swallow)
        app.router.add_post("/v1/chat/completions", self._swallow)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self._port).start()
        self._registration.start()

    async def stop_heartbeats(self) -> None:
        await self._registration.stop(deregister=False)

    async def close(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


async def _through_the_silent_worker(url_a: str, silent: SilentWorker, streams: list[Req],
                                     whole: list[Req]) -> list[Outcome]:
    """Streams, then whole requests, through A while the silent worker is registered (round
    robin gives it half of each batch); then its heartbeats stop."""
    await silent.start()
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + 30
    while f"127.0.0.1:{silent._port}" not in await loop.run_in_executor(None, registered_workers, url_a):
        assert time.monotonic() < deadline, "the silent worker never registered"
        await asyncio.sleep(0.1)
    try:
        got_streams = await send_all(url_a, streams, timeout_s=60.0)
        whole_task = asyncio.create_task(send_all(url_a, whole, timeout_s=60.0))
        while len(silent.received) < len(streams) // 2 + len(whole) // 2:
            assert not whole_task.done(), "whole requests ended before reaching it"
            await asyncio.sleep(0.05)
        await silent.stop_heartbeats()  # A drops it within its heartbeat timeout
        return got_streams + await whole_task
    finally:
        await silent.close()


async def _kill_proxy_mid_stream(cluster: Cluster, proxy_b: Child, url_b: str,
                                 long_reqs: list[Req]) -> tuple[list[Outcome], list[Outcome]]:
    """The same long streams through A and B; B is SIGKILLed once both are streaming (the
    decode worker throttled meanwhile, so they are mid-way)."""
    with Throttle(cluster, cluster.workers[-1]):
        task_a = asyncio.create_task(send_all(cluster.url, long_reqs, timeout_s=90.0))
        task_b = asyncio.create_task(send_all(url_b, long_reqs, timeout_s=90.0))
        await asyncio.sleep(1.0)
        assert proxy_b.proc is not None
        os.killpg(proxy_b.proc.pid, signal.SIGKILL)
        proxy_b.proc.wait(timeout=30)
        got_b = await task_b
    return await task_a, got_b


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_migration_past_a_silent_worker_and_two_proxies(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    http_b, registration_b, silent_port, silent_kv = free_ports(4)
    cluster = Cluster.build(
        tmp_path / "logs", ckpt, num_prefill=1, num_decode=1,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        launch_flags=["--first-byte-timeout", str(FIRST_BYTE_S)],
        # Workers register with both proxies. The KV P computed for the silent worker is
        # released by the proxy once that worker failed: P's 60 s lease is not waited for.
        kv_extra={"proxy_addresses": [f"127.0.0.1:{registration_b}"],
                  "transfer_timeout_s": 5, "orphan_ttl_s": 5})
    proxy_b = cluster.second_proxy(http_b, registration_b)
    url_b = f"http://127.0.0.1:{http_b}"
    workers = [w.http_address for w in cluster.workers]
    streams = [with_limit(r, 24, stream=True) for r in mixed_requests(4, 12)]
    whole = [with_limit(r, 24, stream=False) for r in mixed_requests(4, 12, offset=4)]
    long_reqs = [with_limit(r, LONG_TOKENS, stream=True) for r in mixed_requests(4, 10)]
    try:
        cluster.start([cluster.proxy, proxy_b, *cluster.workers])
        cluster.wait_ready([cluster.proxy, *cluster.workers])
        wait_http(f"{url_b}/health", time.monotonic() + 60, [proxy_b.proc], [proxy_b.log_path])
        while not set(workers) <= registered_workers(url_b):
            time.sleep(0.1)
        want = run_all(url_b, streams + whole + long_reqs)

        # It holds the cluster's secret: what it tests is a worker that fails, not an intruder.
        silent = SilentWorker(f"127.0.0.1:{cluster.registration_port}", silent_port, silent_kv,
                              load_secret_file(cluster.log_dir / CLUSTER_SECRET_FILE))
        got = asyncio.run(_through_the_silent_worker(cluster.url, silent, streams, whole))
        check_matches(streams + whole, got, want[:8])
        assert any(r.get("stream") for r in silent.received), silent.received
        assert any(not r.get("stream") for r in silent.received), silent.received
        moved = labelled_counter(cluster.url.removeprefix("http://"), "pdserve:proxy_migrations")
        assert moved.get("timeout", 0) >= 2 and moved.get("lost", 0) >= 2, moved

        got_a, got_b = asyncio.run(_kill_proxy_mid_stream(cluster, proxy_b, url_b, long_reqs))
        check_matches(long_reqs, got_a, want[8:])  # A's streams never noticed
        # B's were cut mid-way, and its clients saw it (never a complete-looking answer).
        assert all(not o.ok and (o.exception is not None or o.error) for o in got_b), got_b
        check_matches(streams, run_all(cluster.url, streams), want[:4])  # A goes on serving

        scraped = wait_idle(workers, deadline_s=30.0)
        assert not idle_violations(scraped), idle_violations(scraped)
    finally:
        if proxy_b.proc is not None and proxy_b.proc.poll() is None:
            proxy_b.proc.kill()
        if proxy_b.log is not None:
            proxy_b.log.close()
        cluster.stop()
