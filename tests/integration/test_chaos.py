"""Bounded chaos: a 2P3D CPU cluster behind two proxies, under streamed and whole-request
load, while a decode worker, a prefill worker, a decode worker's engine process and a proxy
are SIGKILLed in turn (the proxy restarted, as launch does; a P and a D survive, so the
test needs no worker restarts and stays about a minute past startup).

Judged: no request hangs (every client has a deadline and none reaches it); every request
through the proxy that is never killed completes with the greedy text and usage of an
undisturbed run (requests on a killed P are retried, streams and whole requests on a killed
D or engine migrate), so no 200 is ever truncated; the killed proxy's clients see their
connection cut, never a clean-looking short answer; afterwards every worker's engine and KV
gauges read 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from deploy.launch import Child, free_ports
from tests.integration.cluster_harness import (
    Cluster,
    Outcome,
    Req,
    build_tiny_checkpoint,
    check_matches,
    idle_violations,
    labelled_counter,
    mixed_requests,
    registered_workers,
    run_all,
    send,
    wait_http,
    wait_idle,
    with_limit,
)

CLIENT_TIMEOUT_S = 120.0  # far past any request's time; reaching it is a hang
CONCURRENCY = 6
PAUSE_S = 2.0  # load between two kills


def _wait(predicate: Callable[[], bool], deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


async def _load(url: str, reqs: list[Req], stop: asyncio.Event,
                results: list[tuple[Req, Outcome]]) -> None:
    """``CONCURRENCY`` clients sending ``reqs`` round and round until ``stop``."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(offset: int) -> None:
            i = offset
            while not stop.is_set():
                req = reqs[i % len(reqs)]
                results.append((req, await send(session, url, req, CLIENT_TIMEOUT_S)))
                i += CONCURRENCY

        await asyncio.gather(*(client(k) for k in range(CONCURRENCY)))


def _kill_group(child: Child) -> None:
    assert child.proc is not None
    os.killpg(child.proc.pid, signal.SIGKILL)
    child.proc.wait(timeout=30)


async def _chaos(cluster: Cluster, proxy_b: Child, url_b: str) -> None:
    """SIGKILL D0, P0, D1's engine process and proxy B in turn, load running between; the
    proxy is restarted (the workers register with it again), the workers are not: D2 and P1
    serve on, so every request has somewhere to go."""
    loop = asyncio.get_running_loop()
    decode0, prefill0, decode1 = (cluster.worker(n) for n in ("decode0", "prefill0", "decode1"))
    for victim in (decode0, prefill0):
        await asyncio.sleep(PAUSE_S)
        await loop.run_in_executor(None, _kill_group, victim)
    await asyncio.sleep(PAUSE_S)
    cluster.signal_engine(decode1, signal.SIGKILL)  # its API process exits after it
    assert decode1.proc is not None
    await loop.run_in_executor(None, decode1.proc.wait, 60)
    await asyncio.sleep(PAUSE_S)
    await loop.run_in_executor(None, _kill_group, proxy_b)
    proxy_b.start()
    await loop.run_in_executor(None, _wait, lambda: len(registered_workers(url_b)) == 2, 60.0,
                               "the survivors did not register with the new proxy B")
    await asyncio.sleep(PAUSE_S)


async def _run(cluster: Cluster, proxy_b: Child, url_b: str, reqs: list[Req]
               ) -> tuple[list[tuple[Req, Outcome]], list[tuple[Req, Outcome]]]:
    stop = asyncio.Event()
    through_a: list[tuple[Req, Outcome]] = []
    through_b: list[tuple[Req, Outcome]] = []
    load = [asyncio.create_task(_load(cluster.url, reqs, stop, through_a)),
            asyncio.create_task(_load(url_b, reqs[::-1], stop, through_b))]
    try:
        await _chaos(cluster, proxy_b, url_b)
    finally:
        stop.set()
        await asyncio.gather(*load)
    return through_a, through_b


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_chaos_kills_lose_no_request(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    http_b, registration_b = free_ports(2)
    cluster = Cluster.build(
        tmp_path / "logs", ckpt, num_prefill=2, num_decode=3, heartbeat_s=0.5,
        heartbeat_timeout_s=2.0,
        kv_extra={"proxy_addresses": [f"127.0.0.1:{registration_b}"], "get_lease_s": 5,
                  "transfer_timeout_s": 5, "orphan_ttl_s": 5})
    proxy_b = cluster.second_proxy(http_b, registration_b)
    url_b = f"http://127.0.0.1:{http_b}"
    reqs = [with_limit(r, 8 + 8 * (i % 4)) for i, r in enumerate(mixed_requests(12, 16))]
    workers = [w.http_address for w in cluster.workers]
    try:
        cluster.start([cluster.proxy, proxy_b, *cluster.workers])
        cluster.wait_ready([cluster.proxy, *cluster.workers])
        wait_http(f"{url_b}/health", time.monotonic() + 60, [proxy_b.proc], [proxy_b.log_path])
        _wait(lambda: set(workers) <= registered_workers(url_b), 60.0, "not registered with B")
        want = run_all(cluster.url, reqs)
        assert all(o.ok for o in want), want
        by_req = {id(r): w for r, w in zip(reqs, want)}

        through_a, through_b = asyncio.run(_run(cluster, proxy_b, url_b, reqs))
        assert len(through_a) > 2 * len(reqs), len(through_a)  # load ran throughout
        hung = [o for _, o in through_a + through_b if o.exception and "timeout" in o.exception]
        assert not hung, hung
        check_matches([r for r, _ in through_a], [o for _, o in through_a],
                      [by_req[id(r)] for r, _ in through_a])
        for req, out in through_b:  # cut when B died: the client saw it, never a short 200
            if out.ok:
                check_matches([req], [out], [by_req[id(req)]])
            else:
                assert out.exception is not None or out.error, out
        moved = labelled_counter(cluster.url.removeprefix("http://"), "pdserve:proxy_migrations")
        assert sum(moved.values()) >= 1 and "limit" not in moved, moved

        check_matches(reqs, run_all(url_b, reqs), want)  # the restarted proxy serves
        survivors = [cluster.worker(n).http_address for n in ("prefill1", "decode2")]
        scraped = wait_idle(survivors, deadline_s=30.0)
        assert not idle_violations(scraped), idle_violations(scraped)
    finally:
        if proxy_b.proc is not None and proxy_b.proc.poll() is None:
            proxy_b.proc.kill()
        if proxy_b.log is not None:
            proxy_b.log.close()
        cluster.stop()
