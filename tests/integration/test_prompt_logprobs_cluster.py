"""prompt_logprobs and echo with logprobs on a live 1P1D CPU cluster, through the official
openai client: the answers (numbers included) equal one worker's own, with the first-token
handoff on (proxy A) and off (proxy B), streamed and whole; the cluster ends idle."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from deploy.launch import free_ports
from tests.integration.cluster_harness import (
    MODEL,
    Cluster,
    build_tiny_checkpoint,
    idle_violations,
    labelled_counter,
    registered_workers,
    scrape,
    wait_http,
    wait_idle,
)

PROMPTS = ["the quick brown fox jumps over a lazy dog", "tell me about the sea and the ships"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _answers(client: openai.OpenAI) -> dict[str, object]:
    """Everything these features answer, as plain data (streams merged per choice)."""
    out: dict[str, object] = {}
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4,
                                      temperature=0.0, extra_body={"prompt_logprobs": 2})
    out["prompt_logprobs"] = [(c.text, c.prompt_logprobs) for c in whole.choices]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=3,
        temperature=0.0, extra_body={"prompt_logprobs": 1})
    out["chat"] = (chat.choices[0].message.content, chat.prompt_logprobs)
    for stream in (False, True):
        answer = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4,
                                           temperature=0.0, echo=True, logprobs=2,
                                           stream=stream, n=2 if stream else 1)
        merged: dict[int, dict] = {}
        for chunk in (answer if stream else [answer]):
            for c in chunk.choices:
                into = merged.setdefault(c.index, {"text": "", "tokens": [],
                                                   "token_logprobs": [], "text_offset": []})
                into["text"] += c.text
                if c.logprobs is not None:
                    for key in ("tokens", "token_logprobs", "text_offset"):
                        into[key] += getattr(c.logprobs, key)
        out[f"echo_{stream}"] = merged
    return out


def _same(a: object, b: object) -> bool:
    """Equal, logprob values within float noise."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, abs=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prompt_logprobs_on_1p1d_equal_one_worker(tmp_path: Path) -> None:
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    http_b, registration_b = free_ports(2)
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_prefill=1, num_decode=1,
                            kv_extra={"proxy_addresses": [f"127.0.0.1:{registration_b}"]})
    proxy_b = cluster.second_proxy(http_b, registration_b)
    proxy_b.argv.append("--no-first-token-from-prefill")
    url_b = f"http://127.0.0.1:{http_b}"
    prefill, decode = cluster.workers
    try:
        cluster.start([cluster.proxy, proxy_b, *cluster.workers])
        cluster.wait_ready([cluster.proxy, *cluster.workers])
        wait_http(f"{url_b}/health", time.monotonic() + 60, [proxy_b.proc], [proxy_b.log_path])
        while not {w.http_address for w in cluster.workers} <= registered_workers(url_b):
            time.sleep(0.1)
        want = _answers(_client(f"http://{decode.http_address}"))
        assert all(p is not None for _, p in want["prompt_logprobs"]), want
        assert not scrape(prefill.http_address).get("vllm:prompt_tokens_total")
        for url in (cluster.url, url_b):
            got = _answers(_client(url))
            for key, value in want.items():
                assert _same(got[key], value), (url, key, got[key], value)
        # P computed the prompts; no request fell back to D alone.
        assert scrape(prefill.http_address).get("vllm:prompt_tokens_total")
        for proxy in (cluster.url, url_b):
            assert not labelled_counter(proxy.removeprefix("http://"), "pdserve:proxy_retries")
        # A stream may not ask for them (as vLLM): refused before anything is computed.
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            _client(cluster.url).completions.create(
                model=MODEL, prompt=PROMPTS[0], max_tokens=2, stream=True,
                extra_body={"prompt_logprobs": 1})
        scraped = wait_idle([w.http_address for w in cluster.workers], 30.0)
        assert not idle_violations(scraped), idle_violations(scraped)
    finally:
        cluster.stop()
