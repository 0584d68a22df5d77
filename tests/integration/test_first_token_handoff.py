"""First-token handoff on a live CPU cluster (real processes): the proxy streams P's sampled
token as soon as P answers and D continues after it (``--first-token-from-prefill``).

Every answer must be the one a single worker gives for the same request (text, finish
reason, usage), whether the request took the handoff or, for what it cannot carry (stop
strings, logprobs, one-token answers, non-streaming), the usual path; the cluster must end
idle (P's held blocks freed by D's pull); and a decode worker that is gone when its leg
leaves is replaced by another one, which pulls the KV P still holds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.integration.cluster_harness import (
    Cluster,
    Outcome,
    Req,
    build_tiny_checkpoint,
    idle_violations,
    labelled_counter,
    mixed_requests,
    run_all,
    wait_idle,
)

FLAG = "--first-token-from-prefill"


def _special_requests() -> list[tuple[Req, str]]:
    """Streams beyond the greedy mix, each with the path it must take ('prefill': the
    handoff; else the reason it does not apply)."""
    base = [r for r in mixed_requests(8) if r.stream]
    seeded, penalised, stopped, logprobs, one, chat_seeded = (
        base[0], base[1], base[2], base[3], base[0], base[1])
    out = [
        (replace(seeded, body={**seeded.body, "temperature": 0.9, "top_p": 0.9, "seed": 7}),
         "prefill"),
        (replace(chat_seeded, body={**chat_seeded.body, "temperature": 1.2, "seed": 11}),
         "prefill"),
        (replace(penalised, body={**penalised.body, "repetition_penalty": 1.4,
                                  "frequency_penalty": 0.7, "presence_penalty": 0.3}), "prefill"),
        (replace(stopped, body={**stopped.body, "stop": ["zz", " the"]}), "stop_strings"),
        (replace(logprobs, body={**logprobs.body, "logprobs": True, "top_logprobs": 2}
                 if logprobs.path.endswith("chat/completions") else
                 {**logprobs.body, "logprobs": 2}), "logprobs"),
        (replace(one, limit=1, body={**one.body, "max_tokens": 1}), "max_tokens"),
    ]
    return out


def _check_same(req: Req, got: Outcome, want: Outcome) -> None:
    assert want.ok, (req, want)
    assert got.ok, (req, got)
    assert got.text == want.text, (req.path, req.body, got.text, want.text)
    assert got.finish_reason == want.finish_reason, (req.body, got, want)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert (got.usage or {})[key] == (want.usage or {})[key], (req.body, got.usage, want.usage)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_first_token_from_prefill_matches_a_single_worker(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_prefill=1, num_decode=2,
                            launch_flags=[FLAG])
    prefill0, decode0, decode1 = cluster.workers
    proxy_address = cluster.url.removeprefix("http://")
    mixed = mixed_requests(24)
    specials = _special_requests()
    reqs = mixed + [r for r, _ in specials]
    expected = [("prefill" if r.stream else "not_streaming") for r in mixed] \
        + [path for _, path in specials]
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        cluster.wait_ready(cluster.workers)
        # The reference: one worker serving each whole request itself (no proxy, no handoff).
        want = run_all(f"http://{decode1.http_address}", reqs)
        got = run_all(cluster.url, reqs)
        for req, g, w in zip(reqs, got, want, strict=True):
            _check_same(req, g, w)
        counts = labelled_counter(proxy_address, "pdserve:proxy_first_token_handoffs")
        for path in set(expected):
            assert counts.get(path) == expected.count(path), (path, counts)
        assert "decode" not in counts, counts  # P always answered its token
        # P's blocks held for D were all pulled and freed; nothing waits anywhere.
        scraped = wait_idle([w.http_address for w in cluster.workers], 30.0)
        assert not idle_violations(scraped), idle_violations(scraped)

        # decode0 dies with the proxy still listing it: a handoff whose D leg cannot connect
        # goes on on decode1 (the client already has its first token), which pulls the KV
        # P holds for the transfer: P ends idle without waiting out its lease.
        cluster.kill(decode0)
        streams = [r for r in mixed if r.stream][:8]
        after = run_all(cluster.url, streams)
        for req, g in zip(streams, after, strict=True):
            _check_same(req, g, want[reqs.index(req)])
        retries = labelled_counter(proxy_address, "pdserve:proxy_retries")
        assert retries.get("handoff_decode", 0) >= 1, (retries, cluster.logs())
        scraped = wait_idle([prefill0.http_address, decode1.http_address], 30.0)
        assert not idle_violations(scraped), idle_violations(scraped)
    finally:
        cluster.stop()
