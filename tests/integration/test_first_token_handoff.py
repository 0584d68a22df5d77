"""First-token handoff on a live CPU cluster (real processes): the proxy streams P's sampled
token of each choice as soon as P answers and D continues after it (the default).

Every answer must be the one a single worker gives for the same request (each choice's
text, finish and stop reason, logprobs; usage), whether the request took the handoff
(streams: stop strings inside and right after P's token, logprobs, n = 2 greedy and
seeded, penalties, one-token limits) or the usual path (whole answers); the cluster must
end idle (P's held blocks freed by D's pull); and a decode worker that is gone when its leg
leaves is replaced by another one, which pulls the KV P still holds.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from tests.integration.cluster_harness import (
    MODEL,
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

CHAT = "/v1/chat/completions"


def _special_requests() -> list[Req]:
    """Streams beyond the greedy mix, all taking the handoff."""
    base = [r for r in mixed_requests(8) if r.stream]
    seeded, penalised, one, chat_seeded = base[0], base[1], base[0], base[1]
    return [
        replace(seeded, body={**seeded.body, "temperature": 0.9, "top_p": 0.9, "seed": 7}),
        replace(chat_seeded, body={**chat_seeded.body, "temperature": 1.2, "seed": 11}),
        replace(penalised, body={**penalised.body, "repetition_penalty": 1.4,
                                 "frequency_penalty": 0.7, "presence_penalty": 0.3}),
        replace(one, limit=1, body={**one.body, "max_tokens": 1}),
    ]


def _logprobs(path: str) -> dict:
    return {"logprobs": True, "top_logprobs": 2} if path == CHAT else {"logprobs": 2}


def _feature_bodies(stops: dict[str, str]) -> list[tuple[str, dict]]:
    """n = 2 (greedy, seeded), logprobs, stop strings inside and right after the first
    token (``stops``: from the direct output of ``STOP_PROMPT``), one-token limits."""
    words = "the quick brown fox jumps over a lazy dog"
    out: list[tuple[str, dict]] = []
    for path in ("/v1/completions", CHAT):
        prompt = ({"messages": [{"role": "user", "content": words}]} if path == CHAT
                  else {"prompt": words})
        body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
                **prompt, **_logprobs(path)}
        out += [(path, {**body, "n": 2}),
                (path, {**body, "n": 2, "temperature": 0.9, "seed": 3, "top_p": 0.95}),
                (path, {**body, "n": 2, "max_tokens": 1, "temperature": 1.0, "seed": 4})]
    stop_body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
                 "prompt": STOP_PROMPT, **_logprobs("/v1/completions")}
    out += [("/v1/completions", {**stop_body, "stop": [stop], "include_stop_str_in_output": keep})
            for stop in stops.values() for keep in (False, True)]
    both = [stops["within"], stops["across"]]
    out += [("/v1/completions", {**stop_body, "n": 2, "stop": both}),
            ("/v1/completions", {**stop_body, "n": 2, "temperature": 0.7, "seed": 5,
                                 "stop": both})]
    return out


STOP_PROMPT = "tell me about the sea and the ships"


def _stops(base: str) -> dict[str, str]:
    """Stop strings around the first token of ``STOP_PROMPT``'s direct greedy stream: the
    last two characters of its text (P's token completes it) and its last one with the
    next character (D completes it)."""
    body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
            "prompt": STOP_PROMPT, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    (events,) = asyncio.run(_stream_events(base, body))
    chunks = [(c["text"], len(c["logprobs"]["tokens"])) for e in events
              for c in e.get("choices") or [] if c.get("text")]
    text, first = "".join(t for t, _ in chunks), len(chunks[0][0])
    assert chunks[0][1] == 1 and first >= 2 and len(text) > first, chunks  # one plain token
    stops = {"within": text[first - 2:first], "across": text[first - 1:first + 1]}
    assert "\ufffd" not in "".join(stops.values()), chunks
    return stops


async def _stream_events(base: str, body: dict) -> list[list[dict]]:
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/v1/completions", json=body) as response:
            raw = (await response.read()).decode()
    return [[json.loads(line[6:]) for line in raw.split("\n")
             if line.startswith("data: ") and line != "data: [DONE]"]]


def _choices(events: list[dict]) -> dict[int, dict]:
    """Per choice index, from stream chunks or a whole answer's choices: text, finish and
    stop reason, logprobs (completions' as (token, logprob, top, text offset) rows)."""
    out: dict[int, dict] = {}
    for event in events:
        for c in event.get("choices") or []:
            acc = out.setdefault(c["index"], {"text": "", "finish": None, "stop_reason": None,
                                              "logprobs": []})
            acc["text"] += (c.get("text") or (c.get("delta") or {}).get("content")
                            or (c.get("message") or {}).get("content") or "")
            if c.get("finish_reason"):
                acc["finish"], acc["stop_reason"] = c["finish_reason"], c.get("stop_reason")
            lp = c.get("logprobs")
            if lp and "content" in lp:
                acc["logprobs"] += lp["content"]
            elif lp:
                acc["logprobs"] += [list(row) for row in zip(
                    lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"],
                    strict=True)]
    return out


async def _fetch_all(base: str, reqs: list[tuple[str, dict]]
                     ) -> list[tuple[dict[int, dict], dict]]:
    """(choices, usage) of each request, streamed or whole, all at once."""
    async def one(session: aiohttp.ClientSession, path: str, body: dict
                  ) -> tuple[dict[int, dict], dict]:
        async with session.post(base + path, json=body) as response:
            raw = await response.read()
            assert response.status == 200, raw
        if not body.get("stream"):
            answer = json.loads(raw)
            return _choices([answer]), answer["usage"]
        lines = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]", lines[-3:]
        events = [json.loads(line) for line in lines[:-1]]
        assert not any("error" in e for e in events), events
        return _choices(events), next(e["usage"] for e in reversed(events) if e.get("usage"))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, path, body) for path, body in reqs))


def _same(a: object, b: object) -> bool:
    """Equal, logprob values within float noise (a batch's shape moves the last bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, abs=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


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
    cluster = Cluster.build(tmp_path / "logs", ckpt, num_prefill=1, num_decode=2)
    prefill0, decode0, decode1 = cluster.workers
    proxy_address = cluster.url.removeprefix("http://")
    mixed = mixed_requests(24)
    reqs = mixed + _special_requests()
    expected = [("prefill" if r.stream else "not_streaming") for r in reqs]
    try:
        cluster.start([cluster.proxy, *cluster.workers])
        cluster.wait_ready(cluster.workers)
        # The reference: one worker serving each whole request itself (no proxy, no handoff).
        direct = f"http://{decode1.http_address}"
        features = [(path, {**body, **streamed}) for path, body in _feature_bodies(_stops(direct))
                    for streamed in ({"stream": True, "stream_options": {"include_usage": True}},
                                     {})]
        expected += [("prefill" if body.get("stream") else "not_streaming")
                     for _, body in features]
        want = run_all(direct, reqs)
        want_features = asyncio.run(_fetch_all(direct, features))
        got = run_all(cluster.url, reqs)
        got_features = asyncio.run(_fetch_all(cluster.url, features))
        for req, g, w in zip(reqs, got, want, strict=True):
            _check_same(req, g, w)
        for (path, body), (g_choices, g_usage), (w_choices, w_usage) in zip(
                features, got_features, want_features, strict=True):
            assert len(w_choices) == body.get("n", 1), (body, w_choices)
            assert _same(g_choices, w_choices), (path, body, g_choices, w_choices)
            for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
                assert g_usage[key] == w_usage[key], (body, g_usage, w_usage)
        # Every greedy stop-string request did stop (a seeded one may draw other text).
        for (_, body), (w_choices, _) in zip(features, want_features, strict=True):
            if body.get("stop") and not body.get("temperature"):
                assert all(c["finish"] == "stop" for c in w_choices.values()), (body, w_choices)
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
