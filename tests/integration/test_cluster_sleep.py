"""Sleep mode in a cluster: a decode worker put to sleep leaves the proxy's routing as soon
as its sleep is done (it sends a heartbeat then, not at its next tick), and rejoins as soon
as it is awake; no request reaches it asleep, so the prefill worker holds no KV for one.

Real processes on CPU: a proxy, one prefill and two decode workers as ``pdserve launch``
builds them (sleep mode on; admin endpoints on through ``VLLM_SERVER_DEV_MODE=1``). Every request completes with the same greedy text throughout.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.cluster_harness import (
    Cluster,
    build_tiny_checkpoint,
    check_matches,
    idle_violations,
    mixed_requests,
    request_successes,
    run_all,
    scrape,
    wait_idle,
)

# The workers' heartbeat interval: far longer than the test, so the proxy can only have
# learned of a sleep or a wake-up from the heartbeat sent with it.
HEARTBEAT_S = 60.0
ANNOUNCED_S = 15.0  # far below the heartbeat; a loaded 2-core machine may be slow


def _post(url: str) -> int:
    request = urllib.request.Request(url, method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status


def _sleeping(cluster: Cluster, address: str) -> bool:
    (entry,) = [w for w in cluster.instances() if w["http_address"] == address]
    return entry["load"]["sleeping"]


def _wait_sleeping(cluster: Cluster, address: str, want: bool) -> None:
    """Until the proxy's view of ``address`` says ``want`` (``ANNOUNCED_S`` at most)."""
    start = time.monotonic()
    while _sleeping(cluster, address) != want:
        assert time.monotonic() - start < ANNOUNCED_S, f"{address} still not {want}"
        time.sleep(0.02)


def _retries(cluster: Cluster) -> float:
    """The proxy's retried attempts (every reason): a 503 from an asleep worker is one."""
    return scrape(cluster.url.removeprefix("http://")).get("pdserve:proxy_retries_total", 0.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_asleep_decode_worker_leaves_and_rejoins_routing(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_prefill=1, num_decode=2,
                            heartbeat_s=HEARTBEAT_S)
    prefill0, decode0, decode1 = cluster.workers
    for worker in cluster.workers:
        worker.argv += ["--enable-sleep-mode"]
        # vLLM's switch for the admin endpoints, as a launched worker inherits it.
        worker.env = {**worker.env, "VLLM_SERVER_DEV_MODE": "1"}
    reqs = mixed_requests(8)
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        cluster.wait_ready([cluster.proxy, *cluster.workers])
        want = run_all(cluster.url, reqs)
        assert all(o.ok for o in want), want
        assert request_successes(decode0.http_address) > 0  # round robin used both

        # Asleep: the proxy knows once the sleep answered, and routes nothing to decode0.
        assert _post(f"http://{decode0.http_address}/sleep?level=1") == 200
        _wait_sleeping(cluster, decode0.http_address, True)
        served, retried = request_successes(decode0.http_address), _retries(cluster)
        asleep = run_all(cluster.url, reqs)
        check_matches(reqs, asleep, want)
        assert request_successes(decode0.http_address) == served
        assert _retries(cluster) == retried  # not even tried: it is out of the routing

        # Awake again: routable once the wake-up answered, and it answers as before.
        assert _post(f"http://{decode0.http_address}/wake_up") == 200
        _wait_sleeping(cluster, decode0.http_address, False)
        awake = run_all(cluster.url, reqs)
        check_matches(reqs, awake, want)
        assert request_successes(decode0.http_address) > served
        assert request_successes(decode1.http_address) > 0

        # No request met an asleep worker, so P holds no KV that nobody will pull.
        workers = [w.http_address for w in cluster.workers]
        scraped = wait_idle(workers, 10.0)
        assert not idle_violations(scraped), idle_violations(scraped)
    except Exception:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()
