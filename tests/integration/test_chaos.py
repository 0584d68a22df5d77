"""Bounded chaos: a 2P2D CPU cluster behind two proxies, under streamed and whole-request
load, while a decode worker, a prefill worker, a decode worker's engine process and proxy B
are SIGKILLed in a loop, each restarted before the next kill (``benchmarks.chaos_soak``, the
long soak's own loop, until each kind was killed at least once).

Judged: no request hangs (every client has a deadline and none reaches it); every request
through proxy A, which is never killed, completes with the greedy text and usage of an
undisturbed run (requests on a killed P are retried, streams and whole requests on a killed
D or engine migrate), so no 200 is ever truncated; B's clients see their connection cut when
B dies, never a clean-looking short answer; at least one request migrated; afterwards every
worker's engine and KV gauges read 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.chaos_cluster import ClusterSettings
from benchmarks.chaos_soak import KILL_KINDS, SoakSettings, run_soak
from tests.integration.cluster_harness import ENGINE_ARGS, build_tiny_checkpoint, child_env

# The loop runs this long and until each kind was killed once, whichever is later: here no
# longer than the four kills take (one of each kind is what this test judges; the soak
# itself, ``benchmarks.chaos_soak --minutes``, is for long runs).
CHAOS_S = 0.0
# Load between two kills: 1 s of six clients per proxy puts requests in flight on every
# victim (the soak's default, 2 s, is for long runs).
PAUSE_S = 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_kills_in_a_loop_lose_no_request(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])  # the children run this tree
    topology = ["--prefill", "2", "--decode", "2", "--model", str(ckpt), *ENGINE_ARGS]
    summary = run_soak(SoakSettings(ClusterSettings(topology, tmp_path / "logs"),
                                    duration_s=CHAOS_S, pause_s=PAUSE_S))
    assert summary["hangs"] == 0 and summary["truncated"] == 0, summary
    assert summary["failures"] == {}, summary
    assert summary["leaked_kv"] == {}, summary
    assert all(summary["kills"].get(kind, 0) >= 1 for kind in KILL_KINDS), summary
    assert summary["migrations"] >= 1, summary
    requests = summary["requests"]
    assert requests["through_a"] > 24 and requests["ok"] > 24, summary  # load ran throughout
