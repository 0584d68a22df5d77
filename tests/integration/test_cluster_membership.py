"""Workers joining and dying on a live CPU cluster (real processes).

A worker started after the proxy serves requests within one heartbeat interval of sending its
registration; a SIGKILLed decode worker is dropped within the heartbeat expiry while every
request (its own streams, cut mid-way and migrated; those during the expiry window and after
it) still succeeds with the same greedy text.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.launch import Child
from tests.integration.cluster_harness import (
    Cluster,
    Outcome,
    Req,
    Throttle,
    build_tiny_checkpoint,
    check_matches,
    idle_violations,
    labelled_counter,
    mixed_requests,
    request_successes,
    run_all,
    scrape,
    send_all,
    wait_idle,
    with_limit,
)

# Workers' heartbeat interval, the "within one heartbeat" bound: short, yet a few times what
# a registration plus a first request take on a loaded 2-core machine (about 0.1-0.5 s).
HEARTBEAT_S = 2.0
IDLE_S = 15.0  # well under P's 60 s KV lease: only releases free it this soon
LONG_TOKENS = 180  # streams long enough to be cut mid-way
EXPIRY_S = 5.0        # proxy --heartbeat-timeout (2.5 heartbeats)
EXPIRY_SLACK_S = 3.0  # the expiry task's period (<= 1 s) plus a loaded machine


def _registration_sent_at(log: Path) -> float:
    """Wall-clock time of the worker's 'registering as' log line (its first heartbeat)."""
    line = next(line for line in log.read_text().splitlines() if "registering as" in line)
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    assert stamp, line
    parsed = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
    return parsed.timestamp()


@dataclass
class _KillRun:
    long: list[Outcome]    # the long requests in flight at the kill
    during: list[Outcome]  # requests sent right after it, while the victim is still registered
    dropped_after: float   # seconds from the kill until /instances no longer lists the victim


async def _kill_mid_stream(cluster: Cluster, victim: Child, long_reqs: list[Req],
                           reqs: list[Req]) -> _KillRun:
    """Send the streaming ``long_reqs``; once two of them got their first token on
    ``victim``, send the others and SIGKILL it; then send ``reqs`` at once and watch
    /instances until the victim is dropped.

    The non-streaming requests go out only after the trigger: their first tokens count in
    the same metric, and two of them on the victim first would freeze it before any of its
    streams sent a byte (every stream then retried on the survivor: no cut to judge)."""
    loop = asyncio.get_running_loop()
    ttft = "vllm:time_to_first_token_seconds_count"
    base = scrape(victim.http_address).get(ttft, 0.0)
    streams = [r for r in long_reqs if r.stream]
    assert long_reqs[:len(streams)] == streams, "streaming requests first"
    with Throttle(cluster, victim):
        stream_task = asyncio.create_task(send_all(cluster.url, streams, timeout_s=60.0))
        started = time.monotonic()
        while (await loop.run_in_executor(None, scrape, victim.http_address)
               ).get(ttft, 0.0) < base + 2:
            assert time.monotonic() - started < 30, "no request started on the victim"
            await asyncio.sleep(0.05)
        rest_task = asyncio.create_task(send_all(cluster.url, long_reqs[len(streams):],
                                                 timeout_s=60.0))
        await asyncio.sleep(0.05)  # let them reach the proxy and be routed
    # Freeze its engine so its streams stay mid-way, let the bytes already produced reach
    # the clients, then kill the whole worker.
    cluster.signal_engine(victim, signal.SIGSTOP)
    await asyncio.sleep(0.3)
    await loop.run_in_executor(None, cluster.kill, victim)
    killed = time.monotonic()
    during_task = asyncio.create_task(send_all(cluster.url, reqs, timeout_s=60.0))
    while victim.http_address in await loop.run_in_executor(None, cluster.registered):
        assert time.monotonic() - killed < EXPIRY_S + EXPIRY_SLACK_S + 30, "never dropped"
        await asyncio.sleep(0.1)
    dropped_after = time.monotonic() - killed
    return _KillRun(await stream_task + await rest_task, await during_task, dropped_after)




@pytest.mark.slow
@pytest.mark.timeout(300)
def test_late_worker_used_within_one_heartbeat_and_dead_decode_dropped(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    # D computes the first tokens: the mid-stream kill below waits for first tokens on the
    # victim (vllm:time_to_first_token_seconds, which a handoff's D does not observe).
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_prefill=1, num_decode=2,
                            heartbeat_s=HEARTBEAT_S, heartbeat_timeout_s=EXPIRY_S,
                            launch_flags=["--no-first-token-from-prefill"])
    prefill0, decode0, decode1 = cluster.workers
    reqs = mixed_requests(16)
    try:
        cluster.start([cluster.proxy])
        cluster.wait_ready([cluster.proxy])
        [empty] = run_all(cluster.url, reqs[:1])
        assert empty.status == 503 and empty.error, empty  # no worker yet: a clear refusal

        # Workers started after the proxy join it and serve.
        cluster.start([prefill0, decode0])
        cluster.wait_ready([prefill0, decode0])
        want = run_all(cluster.url, reqs)
        assert all(o.ok for o in want), want

        # A decode worker started later is used within one heartbeat of registering.
        cluster.start([decode1])
        while decode1.http_address not in cluster.registered():
            assert decode1.proc.poll() is None, decode1.log_path.read_text()[-4000:]
            time.sleep(0.02)
        seen = time.time()
        sent = _registration_sent_at(decode1.log_path)
        assert sent <= seen + 0.5, (sent, seen)
        used = None
        probes: list[Outcome] = []
        while used is None and time.time() - sent < 30:
            # Two at once: round robin over two decode workers gives decode1 one of them.
            probes += run_all(cluster.url, reqs[:2])
            if request_successes(decode1.http_address) > 0:
                used = time.time()
        assert all(o.ok for o in probes), probes
        assert used is not None, cluster.logs()
        assert used - sent <= HEARTBEAT_S, (
            f"decode1 first served {used - sent:.2f}s after sending its registration")
        check_matches(reqs[:2] * (len(probes) // 2), probes, want[:2] * (len(probes) // 2))

        # decode0 dies mid-stream: its streams continue on decode1 after the tokens already
        # sent, its whole requests are sent there again; every one completes unbroken.
        long_reqs = [with_limit(r, LONG_TOKENS, stream=True) for r in mixed_requests(6, 10)] \
            + [with_limit(r, LONG_TOKENS, stream=False) for r in mixed_requests(2, 10, offset=6)]
        long_want = run_all(cluster.url, long_reqs)
        assert all(o.ok for o in long_want), long_want
        run = asyncio.run(_kill_mid_stream(cluster, decode0, long_reqs, reqs))
        check_matches(long_reqs, run.long, long_want)
        moved = labelled_counter(cluster.url.removeprefix("http://"),
                                 "pdserve:proxy_migrations")
        assert sum(moved.values()) >= 2 and "limit" not in moved, moved  # its 2+ streams
        # Requests sent in the expiry window went to decode1 (a refused connection is
        # retried); the proxy dropped decode0 within the expiry; later requests succeed.
        assert run.dropped_after <= EXPIRY_S + EXPIRY_SLACK_S, run.dropped_after
        check_matches(reqs, run.during, want)
        check_matches(reqs, run_all(cluster.url, reqs), want)
        assert cluster.registered() == {prefill0.http_address, decode1.http_address}
        # The KV P computed for requests that met the dead decode0 was released by the
        # proxy: P holds nothing within seconds, well inside its 60 s lease.
        scraped = wait_idle([prefill0.http_address, decode1.http_address], IDLE_S)
        assert not idle_violations(scraped), idle_violations(scraped)
    finally:
        cluster.stop()
