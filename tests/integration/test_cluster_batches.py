"""Prompt batches and n samples through a real 1P1D CPU cluster (real processes).

Each prompt of a batch moves its own KV transfer (``T-p<i>`` on both workers) and only a
prompt's first sample loads it; the decode worker's other samples wait for it and find the
prompt in its prefix cache (a single prompt's stream: the first-token handoff, each sample's
first token from P). Answers equal the decode worker's own when it computes
everything itself, no load falls back to recompute, and every worker ends idle (no blocks
held for a transfer nobody pulls).
"""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.integration.cluster_harness import (
    MODEL,
    WORDS,
    Cluster,
    idle_violations,
    scrape,
    wait_idle,
)

LONG = [" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(30 + 9 * i)) for i in range(3)]
CASES = [
    {"prompt": LONG, "temperature": 0.0},                       # a batch, one sample each
    {"prompt": LONG[0], "n": 3, "temperature": 1.0, "seed": 5},  # one prompt, seeded samples
    {"prompt": LONG[1:], "n": 2, "temperature": 0.7, "seed": 9},  # a batch of n samples each
]


def _answer(client: openai.OpenAI, case: dict, stream: bool) -> tuple[list[str], int, int]:
    """(texts by choice index, prompt tokens, completion tokens)."""
    args = {"model": MODEL, "max_tokens": 10, "extra_body": {"ignore_eos": True}, **case}
    if not stream:
        out = client.completions.create(**args)
        return ([c.text for c in sorted(out.choices, key=lambda c: c.index)],
                out.usage.prompt_tokens, out.usage.completion_tokens)
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(**args, stream=True,
                                           stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert usage is not None
    return [texts[i] for i in sorted(texts)], usage.prompt_tokens, usage.completion_tokens


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prompt_batches_and_n_samples_through_1p1d(plain_1p1d: Cluster) -> None:
    cluster = plain_1p1d
    prefill, decode = cluster.workers
    received_before = scrape(decode.http_address)[
        "pdserve:kv_transfer_transfers_received_total"]
    log_start = decode.log_path.stat().st_size
    proxy = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
    direct = openai.OpenAI(base_url=f"http://{decode.http_address}/v1", api_key="x",
                           max_retries=0)
    for case in CASES:
        want = _answer(direct, case, stream=False)
        num_choices = len(case["prompt"]) if isinstance(case["prompt"], list) else 1
        assert len(want[0]) == num_choices * case.get("n", 1)
        for stream in (False, True):
            assert _answer(proxy, case, stream) == want, (case, stream)
    # /tokenize through the proxy: answered by a worker, as that worker answers it.
    body = json.dumps({"model": MODEL, "prompt": LONG[0]}).encode()
    answers = [json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{base}/tokenize", data=body, headers={"Content-Type": "application/json"}),
        timeout=30).read()) for base in (cluster.url, f"http://{decode.http_address}")]
    assert answers[0] == answers[1] and answers[0]["tokens"], answers
    scraped = wait_idle([prefill.http_address, decode.http_address], 30.0)
    assert not idle_violations(scraped), idle_violations(scraped)
    with open(decode.log_path, "rb") as log:
        log.seek(log_start)
        ours = log.read().decode(errors="replace")
    assert "recomputing the prompt locally" not in ours, ours[-3000:]
    # Every prompt's KV came from P once per request, whatever its n; but one: the
    # streamed n = 3 request takes the first-token handoff, so D's request holds P's
    # token after the prompt, and LONG[0] (64 tokens, four whole blocks) is found whole
    # in D's prefix cache from the answers before it (P is told to drop its copy).
    received = (scraped[decode.http_address]["pdserve:kv_transfer_transfers_received_total"]
                - received_before)
    assert received == 2 * (3 + 1 + 2) - 1, received
