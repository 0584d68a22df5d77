"""Prefix-affinity routing on a live CPU cluster (``pdserve launch --routing``).

Two colocated workers, seven long shared prefixes, three rounds of requests that differ
only after the prefix. Round robin sends a prefix to the other worker every round (seven
is odd), so each worker computes it once; prefix affinity keeps each prefix on one worker,
which computes it once in all. The prefix-cache hits of the cluster must show that.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cluster_harness import (
    MODEL,
    WORDS,
    Cluster,
    Req,
    build_tiny_checkpoint,
    run_all,
    scrape,
)

# Distinct from their first token on, so no prefix hits another one's blocks.
PREFIXES = [f"doc{i}: " + " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(48))
            for i in range(7)]


def _hits_after_three_rounds(tmp_path: Path, routing: str) -> float:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    cluster = Cluster.build(tmp_path / f"logs-{routing}", ckpt, num_prefill=0, num_decode=0,
                            launch_flags=["--colocated", "2", "--routing", routing])
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        cluster.wait_ready(cluster.workers)
        for round_ in range(3):
            reqs = [Req("/v1/completions", False, {
                "model": MODEL, "prompt": f"{prefix} question {round_}", "max_tokens": 2,
                "temperature": 0}, 2) for prefix in PREFIXES]
            outcomes = run_all(cluster.url, reqs, concurrency=1)
            assert all(o.ok for o in outcomes), outcomes
        return sum(scrape(w.http_address)["vllm:prefix_cache_hits_total"]
                   for w in cluster.workers)
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prefix_affinity_turns_repeated_prefixes_into_cache_hits(tmp_path: Path) -> None:
    spread = _hits_after_three_rounds(tmp_path, "round_robin")
    affine = _hits_after_three_rounds(tmp_path, "prefix_affinity")
    # Round robin: each prefix hits only in round 3 (computed on both workers in rounds 1-2);
    # affinity: in rounds 2 and 3. Twice the hits, less the partial blocks.
    assert affine >= 1.8 * spread > 0, (affine, spread)
