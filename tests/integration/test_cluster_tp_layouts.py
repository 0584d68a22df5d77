"""KV transfer between tensor-parallel layouts in a real CPU cluster: a prefill worker of TP=a
hands its KV to a decode worker of TP=b over the CPU transport, each rank moving only its
heads straight to the peer rank(s) that keep them; the answers equal a colocated TP=1
server's (the session's ``reference``), every load lands, and nothing is held at the end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.cluster_harness import (
    Cluster,
    Reference,
    check_matches,
    idle_violations,
    run_all,
    scrape,
    wait_idle,
)

NUM_REQUESTS = 8  # prompts of 1 to 4 blocks; completions and chat; streams


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_transfer_between_layouts_matches_colocated(reference: Reference, tmp_path: Path,
                                                    prefill_tp: int, decode_tp: int) -> None:
    """The tiny checkpoint has 2 KV heads: one a rank at TP=2."""
    requests, want = reference.first(NUM_REQUESTS)
    checkpoint = reference.checkpoint
    cluster = Cluster.build(tmp_path, checkpoint, num_prefill=1, num_decode=1,
                            launch_flags=["--prefill-tp", str(prefill_tp),
                                          "--decode-tp", str(decode_tp),
                                          "--kv-transport", "cpu"])
    prefill, decode = cluster.worker("prefill0"), cluster.worker("decode0")
    try:
        cluster.start([cluster.proxy, prefill, decode])
        cluster.wait_ready([cluster.proxy, prefill, decode])
        ranks = {w["role"]: w["kv_ranks"] for w in cluster.instances()}
        assert len(ranks["P"]["addresses"]) == prefill_tp
        assert len(ranks["D"]["addresses"]) == decode_tp

        check_matches(requests, run_all(cluster.url, requests), want)

        addresses = [prefill.http_address, decode.http_address]
        scraped = wait_idle(addresses, 30.0)
        assert not idle_violations(scraped), (idle_violations(scraped), cluster.logs())
        for address in addresses:
            assert scraped[address].get("pdserve:kv_transfer_rank_reports_pending", 0.0) == 0
        d_metrics, p_metrics = scrape(decode.http_address), scrape(prefill.http_address)
        # Every request with a full block moved it, one transfer per route; the worker's
        # counters sum its ranks', so every route P sent landed on D.
        received = d_metrics["pdserve:kv_transfer_transfers_received_total"]
        assert received >= NUM_REQUESTS // 2
        assert received == p_metrics["pdserve:kv_transfer_transfers_sent_total"]
        assert d_metrics["pdserve:kv_transfer_transfers_failed_total"] == 0
        assert d_metrics["pdserve:kv_transfer_transfers_timed_out_total"] == 0
        decode_log = decode.log_path.read_text()
        assert "recomputing the prompt locally" not in decode_log, decode_log[-4000:]
        assert "kv load" not in decode_log, decode_log[-4000:]
    finally:
        cluster.stop()
