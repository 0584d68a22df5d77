"""The two server halves of the first-token handoff, on one real server.

A request answered for one token with ``first_token_events`` returns the stream events of
that token; the same request continued with ``generated_token_ids`` streams the rest. Sent
one after the other, the two must carry exactly the text, finish reason and usage of the
uninterrupted stream, with one chat role chunk in all (the proxy glues them the same way).
"""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.server.conftest import MODEL_NAME

MSG = [{"role": "user", "content": "tell me about the sea and the ships"}]
CASES = {
    "completions": ("/v1/completions", {"prompt": "The quick brown fox jumps over"}),
    "chat": ("/v1/chat/completions", {"messages": MSG}),
    "chat seeded": ("/v1/chat/completions", {"messages": MSG, "temperature": 1.0, "seed": 3}),
    "penalties": ("/v1/completions", {"prompt": "a b a b a b a", "repetition_penalty": 1.3,
                                      "frequency_penalty": 0.5}),
    "min_tokens": ("/v1/chat/completions", {"messages": MSG, "min_tokens": 4,
                                            "ignore_eos": False}),
}


def _stream_events(raw: bytes) -> list[dict]:
    events = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def _text(events: list[dict]) -> str:
    out = ""
    for event in events:
        for choice in event.get("choices") or []:
            out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


def _finish(events: list[dict]) -> str | None:
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices") or []]
    return next((r for r in reversed(reasons) if r), None)


async def _histogram_sum(session: aiohttp.ClientSession, server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(server.url + "/metrics") as response:
        text = await response.text()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == f"{name}_sum")


def _usage(events: list[dict]) -> dict:
    return next(e["usage"] for e in reversed(events) if e.get("usage"))


@pytest.mark.parametrize("case", sorted(CASES))
async def test_first_events_plus_continuation_is_the_whole_stream(server, auth, case) -> None:
    path, extra = CASES[case]
    body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 10, "ignore_eos": True,
            **extra, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.post(server.url + path, json=body) as response:
            assert response.status == 200
            whole = _stream_events(await response.read())
        # The client's own limits: the server validates them and samples one token.
        first_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first_body |= {"kv_transfer_params": {"first_token_events": True}}
        async with session.post(server.url + path, json=first_body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["usage"]["completion_tokens"] == 1
        first = answer["pdserve_first_token"]
        assert len(first["token_ids"]) == 1
        rest_body = {**body, "kv_transfer_params": {"generated_token_ids": first["token_ids"]}}
        longest = await _histogram_sum(session, server, "vllm:request_max_num_generation_tokens")
        async with session.post(server.url + path, json=rest_body) as response:
            assert response.status == 200, await response.text()
            rest = _stream_events(await response.read())
        # The continuation generated 9 of the 10 tokens here: the handed-over one is not
        # this worker's (as in vllm:request_generation_tokens).
        assert await _histogram_sum(
            session, server, "vllm:request_max_num_generation_tokens") - longest == 9
    glued = first["events"] + rest
    assert _text(glued) == _text(whole) and _text(whole)
    assert _finish(glued) == _finish(whole)
    assert _usage(rest)["completion_tokens"] == _usage(whole)["completion_tokens"]
    assert _usage(rest)["prompt_tokens"] == _usage(whole)["prompt_tokens"]
    roles = [e for e in glued if (e["choices"] or [{}])[0].get("delta", {}).get("role")]
    assert len(roles) == (1 if path.endswith("chat/completions") else 0)
    ids = {e["id"] for e in glued} | {e["id"] for e in whole}
    assert len({i.split("-")[0] for i in ids}) == 1


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": "The quick brown fox"}),
                                        ("/v1/chat/completions", {"messages": MSG})])
@pytest.mark.parametrize("token_id", [1 << 32, 10 ** 12])
async def test_generated_token_beyond_the_vocabulary_is_a_400(server, auth, path, extra,
                                                              token_id) -> None:
    """The front end decodes handed-over tokens before the engine checks them: an id the
    tokenizer cannot even take (past 32 bits) must be the client's 400, not a 500."""
    async with aiohttp.ClientSession(headers=auth) as session:
        for stream in (False, True):
            body = {"model": MODEL_NAME, "max_tokens": 4, "stream": stream, **extra,
                    "kv_transfer_params": {"generated_token_ids": [[token_id]]}}
            async with session.post(server.url + path, json=body) as response:
                assert response.status == 400, await response.text()
                error = (await response.json())["error"]
            assert "generated token ids" in error["message"]
    assert server.wait_idle().num_running == 0


async def test_first_token_request_is_checked_with_the_clients_limit_against_the_cache(
        demo_checkpoint, auth) -> None:
    """A prefill worker's engine samples one token for the handoff, so its own admission
    check sees ``max_tokens`` 1: the client's limit must still be checked against the KV
    cache (as D will check it) before the first token streams, not fail on D after it."""
    from engine_core.config import CacheConfig, EngineConfig, ModelConfig
    from engine_core.server.api_server import ServerOptions
    from tests.server.conftest import API_KEY, MAX_MODEL_LEN, ServerHandle

    config = EngineConfig(  # 4 blocks of 16 tokens: a cache of 64, below max_model_len
        model=ModelConfig(model=str(demo_checkpoint), max_model_len=MAX_MODEL_LEN,
                          served_model_name=MODEL_NAME),
        cache=CacheConfig(num_gpu_blocks_override=4, block_size=16))
    small = ServerHandle(config, ServerOptions(api_key=API_KEY, log_stats_interval_s=0))
    try:
        async with aiohttp.ClientSession(headers=auth) as session:
            for handoff in ({"first_token_events": True}, None):
                for max_tokens, status in ((100, 400), (20, 200)):
                    body = {"model": MODEL_NAME, "prompt": "The quick brown fox",
                            "max_tokens": max_tokens, "ignore_eos": True}
                    if handoff:
                        body["kv_transfer_params"] = handoff
                    async with session.post(small.url + "/v1/completions",
                                            json=body) as response:
                        assert response.status == status, await response.text()
                        answer = await response.json()
                    if status == 400:
                        assert "KV cache holds 64 tokens" in answer["error"]["message"]
                        assert answer["error"]["param"] == "max_tokens"
                    elif handoff:
                        assert answer["usage"]["completion_tokens"] == 1
        assert small.wait_idle().num_running == 0
    finally:
        small.stop()


def _stop_reason(events: list[dict]) -> int | str | None:
    return next((c.get("stop_reason") for e in reversed(events) for c in e.get("choices") or []
                 if c.get("finish_reason")), None)


STOP_CASES = {
    "chat stop id": ("/v1/chat/completions", {"messages": MSG, "allowed_token_ids": [50],
                                              "stop_token_ids": [50]}),
    "chat stop id kept": ("/v1/chat/completions", {
        "messages": MSG, "allowed_token_ids": [50], "stop_token_ids": [50],
        "include_stop_str_in_output": True}),
    "completions eos shown": ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [0],
                                                  "skip_special_tokens": False}),
    "completions eos kept": ("/v1/completions", {
        "prompt": "hi", "allowed_token_ids": [0], "skip_special_tokens": False,
        "include_stop_str_in_output": True}),
}


@pytest.mark.parametrize("case", sorted(STOP_CASES))
async def test_a_first_token_that_stops_the_request_streams_as_directly(server, auth,
                                                                         case) -> None:
    """P's sampled token is a stop (EOS, a stop_token_ids entry): its text is dropped as a
    direct stream drops it (kept with include_stop_str_in_output), and the continuation,
    which finds the request ended by that token, sends the finish and stop reason. Before,
    P's events carried the stopping token's text ("P", "<|endoftext|>")."""
    path, extra = STOP_CASES[case]
    body = {"model": MODEL_NAME, "max_tokens": 4, **extra, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.post(server.url + path, json=body) as response:
            assert response.status == 200
            whole = _stream_events(await response.read())
        first_body = {**body, "kv_transfer_params": {"first_token_events": True}}
        async with session.post(server.url + path, json=first_body) as response:
            assert response.status == 200, await response.text()
            first = (await response.json())["pdserve_first_token"]
        rest_body = {**body, "kv_transfer_params": {"generated_token_ids": first["token_ids"]}}
        async with session.post(server.url + path, json=rest_body) as response:
            assert response.status == 200, await response.text()
            rest = _stream_events(await response.read())
    glued = first["events"] + rest
    assert _finish(whole) == "stop"
    assert _text(glued) == _text(whole)
    assert _finish(glued) == _finish(whole)
    assert _stop_reason(glued) == _stop_reason(whole)
    assert all(not c.get("finish_reason") for e in first["events"] for c in e["choices"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert _usage(rest)[key] == _usage(whole)[key], key


# ---- what a whole stream carries: n choices, logprobs, stop strings, one-token limits ----

def _choices(events: list[dict]) -> dict[int, dict]:
    """Per choice index: its text, finish, stop reason and logprobs, events glued."""
    out: dict[int, dict] = {}
    for event in events:
        for c in event.get("choices") or []:
            acc = out.setdefault(c["index"], {"text": "", "finish": None, "stop_reason": None,
                                              "logprobs": []})
            acc["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            if c.get("finish_reason"):
                acc["finish"], acc["stop_reason"] = c["finish_reason"], c.get("stop_reason")
            lp = c.get("logprobs")
            if lp and "content" in lp:  # chat
                acc["logprobs"] += lp["content"]
            elif lp:  # completions: one entry per token, with its text offset
                acc["logprobs"] += [list(row) for row in zip(
                    lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"],
                    strict=True)]
    return out


async def _whole_and_glued(session: aiohttp.ClientSession, server, path: str,
                           body: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """The uninterrupted stream; P's first events followed by D's continuation; D's part."""
    async with session.post(server.url + path, json=body) as response:
        assert response.status == 200, await response.text()
        whole = _stream_events(await response.read())
    first_body = {**body, "kv_transfer_params": {"first_token_events": True}}
    async with session.post(server.url + path, json=first_body) as response:
        assert response.status == 200, await response.text()
        first = (await response.json())["pdserve_first_token"]
    assert len(first["token_ids"]) == body.get("n", 1)
    rest_body = {**body, "kv_transfer_params": {"generated_token_ids": first["token_ids"]}}
    async with session.post(server.url + path, json=rest_body) as response:
        assert response.status == 200, await response.text()
        rest = _stream_events(await response.read())
    return whole, first["events"] + rest, rest


def _same(a: object, b: object) -> bool:
    """Equal, logprob values within float noise (a batch's shape moves the last bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, abs=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _assert_same_stream(whole: list[dict], glued: list[dict], rest: list[dict]) -> None:
    assert _same(_choices(glued), _choices(whole)), (_choices(glued), _choices(whole))
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # cached: the cache's
        assert _usage(rest)[key] == _usage(whole)[key], key


FEATURE_CASES = {
    "completions n=2 seeded logprobs": ("/v1/completions", {
        "prompt": "The quick brown fox jumps over", "n": 2, "temperature": 1.0, "seed": 5,
        "logprobs": 2}),
    "chat n=2 seeded top_logprobs": ("/v1/chat/completions", {
        "messages": MSG, "n": 2, "temperature": 0.8, "top_p": 0.9, "seed": 9,
        "logprobs": True, "top_logprobs": 3, "presence_penalty": 0.5}),
    "completions greedy logprobs": ("/v1/completions", {"prompt": "a b a b a b a",
                                                        "logprobs": 0}),
    "chat max_tokens=1 n=2": ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1,
                                                       "n": 2, "temperature": 1.0, "seed": 1}),
    "completions max_tokens=1 logprobs": ("/v1/completions", {
        "prompt": "The quick brown fox", "max_tokens": 1, "logprobs": 1}),
}


@pytest.mark.parametrize("case", sorted(FEATURE_CASES))
async def test_choices_logprobs_and_seeds_cross_the_handoff(server, auth, case) -> None:
    """Each choice's first token from P (seed + index, as the direct run draws it), its
    logprobs in P's events, and D's continuation drawing the seeded stream on from the
    next position with penalties counting P's token: the glued stream is the whole one,
    per choice (text, finish, logprobs with completions' text offsets) and in usage."""
    path, extra = FEATURE_CASES[case]
    body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
            **extra, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers=auth) as session:
        whole, glued, rest = await _whole_and_glued(session, server, path, body)
    _assert_same_stream(whole, glued, rest)
    assert len(_choices(whole)) == body.get("n", 1)
    assert all(len(c["logprobs"]) == (body["max_tokens"] if "logprobs" in extra else 0)
               for c in _choices(whole).values())


PROMPTS = ["The quick brown fox jumps over", "tell me about the sea and the ships",
           "a b a b a b a", "Once upon a time there was", "hello world, hello sea"]


def _chunk_texts(events: list[dict]) -> list[tuple[str, int]]:
    """(text, tokens) of each chunk that carries text (tokens counted by its logprobs)."""
    out = []
    for event in events:
        for c in event.get("choices") or []:
            text = c.get("text") or (c.get("delta") or {}).get("content")
            lp = c.get("logprobs") or {}
            if text:
                out.append((text, len(lp.get("content") or lp.get("tokens") or [])))
    return out


async def _stops_around_first_token(session: aiohttp.ClientSession, server, path: str,
                                    body: dict) -> tuple[dict, dict[str, str]]:
    """A body (one of ``PROMPTS``) whose direct stream's first token is plain text of 2+
    characters alone in its chunk, and stop strings inside it, across its end and later."""
    for prompt in PROMPTS:
        probe = ({**body, "prompt": prompt} if path == "/v1/completions" else
                 {**body, "messages": [{"role": "user", "content": prompt}]})
        async with session.post(server.url + path, json=probe) as response:
            chunks = _chunk_texts(_stream_events(await response.read()))
        text = "".join(t for t, _ in chunks)
        first = len(chunks[0][0]) if chunks and chunks[0][1] == 1 else 0
        stops = {"within": text[first - 2:first], "across": text[first - 1:first + 1],
                 "later": text[first + 3:first + 6]}
        if first >= 2 and all(len(v) >= 2 and "\ufffd" not in v for v in stops.values()):
            return probe, stops
    raise AssertionError("no prompt with a plain first token")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stop_strings_within_and_after_the_handed_token(server, auth, path) -> None:
    """Stop strings taken from the direct output: one inside the first token's text (P's
    token completes it: D only sends the finish), one across its end (D completes it, the
    held-back text of P's token released then or dropped), and one later; each glued
    stream is the direct one, logprobs included, with ``include_stop_str_in_output``
    either way."""
    logprobs = {"logprobs": 1} if path == "/v1/completions" else {"logprobs": True}
    body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
            **logprobs, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(headers=auth) as session:
        body, stops = await _stops_around_first_token(session, server, path, body)
        for include in (False, True):
            for where, stop in stops.items():
                stream_body = {**body, "stop": [stop], "include_stop_str_in_output": include}
                whole, glued, rest = await _whole_and_glued(session, server, path, stream_body)
                _assert_same_stream(whole, glued, rest)
                assert _choices(whole)[0]["finish"] == "stop", (where, stop, whole)
    assert server.wait_idle().num_running == 0
