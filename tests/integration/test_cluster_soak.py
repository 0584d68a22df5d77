"""Soak: 500 requests, 64 at a time, through a real 2P2D CPU cluster; then nothing is held.

Afterwards every worker's /metrics must show an idle engine (no request running or waiting,
KV cache usage 0) and an idle connector (every transfer gauge and buffer byte count 0), and
the proxy must count no leg in flight. Identical requests must get identical greedy text
whichever (P, D) pair served them, and no decode worker may have fallen back to recompute.
Run twice: D computing the first token, and the proxy streaming P's (first-token handoff).
The mode is the proxy's alone, so one set of workers serves both runs: they register with
two proxies, one per mode.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from deploy.launch import Child, free_ports
from tests.integration.cluster_harness import (
    Cluster,
    build_tiny_checkpoint,
    check_usage,
    get_json,
    idle_violations,
    mixed_requests,
    registered_workers,
    request_successes,
    run_all,
    wait_http,
    wait_idle,
)

NUM_REQUESTS = 500
CONCURRENCY = 64
DISTINCT = 50  # each distinct request is sent 10 times, shuffled


@dataclass
class SoakCluster:
    """2P2D workers behind a proxy without the handoff (``plain``) and one with it."""

    cluster: Cluster
    handoff_proxy: Child
    urls: dict[str, str]


@pytest.fixture(scope="module")
def soak_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SoakCluster]:
    root = tmp_path_factory.mktemp("soak")
    http_b, registration_b = free_ports(2)
    cluster = Cluster.build(root / "logs", build_tiny_checkpoint(root / "ckpt"),
                            num_prefill=2, num_decode=2,
                            launch_flags=["--no-first-token-from-prefill"],
                            kv_extra={"proxy_addresses": [f"127.0.0.1:{registration_b}"]})
    handoff = cluster.second_proxy(http_b, registration_b)
    handoff.argv.remove("--no-first-token-from-prefill")
    url_b = f"http://127.0.0.1:{http_b}"
    workers = {w.http_address for w in cluster.workers}
    try:
        cluster.start([cluster.proxy, handoff, *cluster.workers])
        cluster.wait_ready([cluster.proxy, *cluster.workers])
        deadline = time.monotonic() + 60
        wait_http(f"{url_b}/health", deadline, [handoff.proc], [handoff.log_path])
        while not workers <= registered_workers(url_b):
            assert time.monotonic() < deadline, "the workers did not register with proxy B"
            time.sleep(0.1)
        yield SoakCluster(cluster, handoff, {"plain": cluster.url, "first-token-handoff": url_b})
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["plain", "first-token-handoff"])
def test_soak_500_requests_leaves_every_worker_idle(soak_cluster: SoakCluster,
                                                    mode: str) -> None:
    cluster, url = soak_cluster.cluster, soak_cluster.urls[mode]
    distinct = mixed_requests(DISTINCT, max_words=12, max_tokens=6)
    reqs = distinct * (NUM_REQUESTS // DISTINCT)
    random.Random(0).shuffle(reqs)
    addresses = [w.http_address for w in cluster.workers]
    served_before = {a: request_successes(a) for a in addresses}
    started = time.monotonic()
    got = run_all(url, reqs, concurrency=CONCURRENCY, timeout_s=180.0)
    elapsed = time.monotonic() - started
    failed = [(r.body, o) for r, o in zip(reqs, got) if not o.ok]
    assert not failed, f"{len(failed)} of {len(reqs)} failed: {failed[:3]}"
    first: dict[int, object] = {}
    for req, out in zip(reqs, got):
        ref = first.setdefault(id(req), out)
        assert out.text == ref.text, (req.body, out.text, ref.text)
        check_usage(req, out, ref)

    scraped = wait_idle(addresses, 30.0)
    assert not idle_violations(scraped), (idle_violations(scraped), elapsed)
    for address, metrics in scraped.items():  # every worker served in this run
        assert metrics["vllm:request_success_total"] > served_before[address], address
    for proxy_url in soak_cluster.urls.values():
        instances = get_json(f"{proxy_url}/instances")
        assert instances["in_flight"] == 0, instances
        assert all(w["in_flight"] == 0 and w["num_errors"] == 0
                   for w in instances["workers"]), instances
    for child in cluster.workers:
        log = child.log_path.read_text()
        assert "recomputing the prompt locally" not in log, log[-3000:]
        assert "kv load" not in log, log[-3000:]
