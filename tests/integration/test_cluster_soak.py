"""Soak: 500 requests, 64 at a time, through a real 2P2D CPU cluster; then nothing is held.

Afterwards every worker's /metrics must show an idle engine (no request running or waiting,
KV cache usage 0) and an idle connector (every transfer gauge and buffer byte count 0), and
the proxy must count no leg in flight. Identical requests must get identical greedy text
whichever (P, D) pair served them, and no decode worker may have fallen back to recompute.
Run twice: D computing the first token, and the proxy streaming P's (first-token handoff).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.integration.cluster_harness import (
    Cluster,
    build_tiny_checkpoint,
    check_usage,
    get_json,
    idle_violations,
    mixed_requests,
    run_all,
    wait_idle,
)

NUM_REQUESTS = 500
CONCURRENCY = 64
DISTINCT = 50  # each distinct request is sent 10 times, shuffled


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("launch_flags", [["--no-first-token-from-prefill"], []],
                         ids=["plain", "first-token-handoff"])
def test_soak_500_requests_leaves_every_worker_idle(tmp_path: Path,
                                                    launch_flags: list[str]) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_prefill=2, num_decode=2,
                            launch_flags=launch_flags)
    distinct = mixed_requests(DISTINCT, max_words=12, max_tokens=6)
    reqs = distinct * (NUM_REQUESTS // DISTINCT)
    random.Random(0).shuffle(reqs)
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        cluster.wait_ready([cluster.proxy, *cluster.workers])
        started = time.monotonic()
        got = run_all(cluster.url, reqs, concurrency=CONCURRENCY, timeout_s=180.0)
        elapsed = time.monotonic() - started
        failed = [(r.body, o) for r, o in zip(reqs, got) if not o.ok]
        assert not failed, f"{len(failed)} of {len(reqs)} failed: {failed[:3]}"
        first: dict[int, object] = {}
        for req, out in zip(reqs, got):
            ref = first.setdefault(id(req), out)
            assert out.text == ref.text, (req.body, out.text, ref.text)
            check_usage(req, out, ref)

        addresses = [w.http_address for w in cluster.workers]
        scraped = wait_idle(addresses, 30.0)
        assert not idle_violations(scraped), (idle_violations(scraped), elapsed)
        for address, metrics in scraped.items():
            assert metrics["vllm:request_success_total"] > 0, address  # every worker served
        instances = get_json(f"{cluster.url}/instances")
        assert instances["in_flight"] == 0, instances
        assert all(w["in_flight"] == 0 and w["num_errors"] == 0
                   for w in instances["workers"]), instances
        for child in cluster.workers:
            log = child.log_path.read_text()
            assert "recomputing the prompt locally" not in log, log[-3000:]
            assert "kv load" not in log, log[-3000:]
    finally:
        cluster.stop()
