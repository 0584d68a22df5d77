"""Prefix-affinity routing on a live CPU cluster (``pdserve launch --routing``).

Two colocated workers, seven long shared prefixes, three rounds of requests that differ
only after the prefix. Round robin sends a prefix to the other worker every round (seven
is odd), so each worker computes it once; prefix affinity keeps each prefix on one worker,
which computes it once in all. The prefix-cache hits of the cluster must show that.
Routing is the proxy's alone, so the two workers register with two proxies, one per policy,
and each policy gets prefixes of its own (no block of one run is a hit for the other).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deploy.launch import free_ports
from tests.integration.cluster_harness import (
    MODEL,
    WORDS,
    Cluster,
    Req,
    build_tiny_checkpoint,
    registered_workers,
    run_all,
    scrape,
    wait_http,
)


def _prefixes(tag: str) -> list[str]:
    """Seven prefixes distinct from their first token on, so no prefix hits another one's
    blocks (nor one of another ``tag``)."""
    return [f"{tag} doc{i}: " + " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(48))
            for i in range(7)]


def _cache_hits(cluster: Cluster) -> float:
    return sum(scrape(w.http_address)["vllm:prefix_cache_hits_total"] for w in cluster.workers)


def _hits_of_three_rounds(cluster: Cluster, url: str, tag: str) -> float:
    """The cluster's new prefix-cache hits over three rounds through the proxy at ``url``."""
    before = _cache_hits(cluster)
    for round_ in range(3):
        reqs = [Req("/v1/completions", False, {
            "model": MODEL, "prompt": f"{prefix} question {round_}", "max_tokens": 2,
            "temperature": 0}, 2) for prefix in _prefixes(tag)]
        outcomes = run_all(url, reqs, concurrency=1)
        assert all(o.ok for o in outcomes), outcomes
    return _cache_hits(cluster) - before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prefix_affinity_turns_repeated_prefixes_into_cache_hits(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    http_b, registration_b = free_ports(2)
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_prefill=0, num_decode=0,
                            launch_flags=["--colocated", "2", "--routing", "prefix_affinity"])
    spreading = cluster.second_proxy(http_b, registration_b)
    spreading.argv[spreading.argv.index("--routing") + 1] = "round_robin"
    for worker in cluster.workers:  # each registers with both proxies
        index = worker.argv.index("--proxy-address") + 1
        worker.argv[index] += f",127.0.0.1:{registration_b}"
    url_b = f"http://127.0.0.1:{http_b}"
    try:
        cluster.start([cluster.proxy, spreading, *cluster.workers])
        cluster.wait_ready(cluster.workers)
        deadline = time.monotonic() + 60
        wait_http(f"{url_b}/health", deadline, [spreading.proc], [spreading.log_path])
        while not {w.http_address for w in cluster.workers} <= registered_workers(url_b):
            assert time.monotonic() < deadline, "the workers did not register with proxy B"
            time.sleep(0.1)
        spread = _hits_of_three_rounds(cluster, url_b, "spread")
        affine = _hits_of_three_rounds(cluster, cluster.url, "affine")
    finally:
        cluster.stop()
    # Round robin: each prefix hits only in round 3 (computed on both workers in rounds 1-2);
    # affinity: in rounds 2 and 3. Twice the hits, less the partial blocks.
    assert affine >= 1.8 * spread > 0, (affine, spread)
