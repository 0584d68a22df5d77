"""A prefill leg (``do_remote_decode``) on a real server: the proxy sends it the client's own
request, which it validates exactly as a decode (or colocated) worker does before running
anything, then runs as one token of one sample per prompt, answered as one JSON body.

Before, the proxy rewrote P's request (max_tokens 1, n 1, no min_tokens or
stream_options), so P accepted what D then refused and held the prompt's KV for a pull
that never came until its lease ran out.
"""

from __future__ import annotations

import aiohttp
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "tell me about the sea"}]
LONG = "some words here " * 26  # ~105 tokens: with max_tokens 250 past the context of 256


def _leg(transfer_id: str) -> dict:
    # This worker has no connector: the params only mark the request as a prefill leg.
    return {"do_remote_decode": True, "transfer_id": transfer_id,
            "remote_kv_address": "127.0.0.1:9"}


REFUSED = [
    ("context with the real max_tokens", C, {"prompt": LONG, "max_tokens": 250}, "max_tokens"),
    ("max_tokens wrong type", C, {"prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
    ("n zero", C, {"prompt": "hi", "n": 0}, "n"),
    ("min_tokens negative", C, {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("min_tokens above max_tokens", C, {"prompt": "hi", "max_tokens": 3, "min_tokens": 5},
     "min_tokens"),
    ("stream_options without stream", C, {"prompt": "hi",
                                          "stream_options": {"include_usage": True}},
     "stream_options"),
    ("chat context with max_completion_tokens", CHAT,
     {"messages": [{"role": "user", "content": LONG}], "max_completion_tokens": 250},
     "max_tokens"),
    ("too many choices", C, {"prompt": ["a"] * 9, "n": 128}, "prompt"),
]


@pytest.mark.parametrize("name,path,body,param", REFUSED, ids=[c[0] for c in REFUSED])
async def test_a_prefill_leg_is_refused_as_the_decode_worker_refuses_it(
        server, auth, name, path, body, param) -> None:
    before = server.stats().prompt_tokens_total
    async with aiohttp.ClientSession(headers=auth) as session:
        for kv in (None, _leg("t-refused")):  # the same answer, leg or not
            full = {"model": MODEL_NAME, **body, **({"kv_transfer_params": kv} if kv else {})}
            async with session.post(server.url + path, json=full) as response:
                assert response.status == 400, await response.text()
                error = (await response.json())["error"]
            assert error["param"] == param, error
    # Refused before the engine saw it: no prompt token was computed (none held for D).
    assert server.stats().prompt_tokens_total == before


@pytest.mark.parametrize("path,extra", [
    (C, {"prompt": "The quick brown fox", "max_tokens": 40}),
    (C, {"prompt": ["a b c", "d e f g"], "max_tokens": 40}),
    (CHAT, {"messages": MSG, "max_completion_tokens": 40}),
])
async def test_a_valid_prefill_leg_runs_one_token_per_prompt(server, auth, path, extra) -> None:
    """The client's n, min_tokens and stream stay in the request (validated), but each
    prompt runs once, for one token, and the answer is one JSON body."""
    body = {"model": MODEL_NAME, **extra, "n": 3, "min_tokens": 5, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
            "kv_transfer_params": _leg("t-valid")}
    num_prompts = len(extra["prompt"]) if isinstance(extra.get("prompt"), list) else 1
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.post(server.url + path, json=body) as response:
            assert response.status == 200, await response.text()
            assert response.content_type == "application/json"
            answer = await response.json()
    assert len(answer["choices"]) == num_prompts
    assert answer["usage"]["completion_tokens"] == num_prompts
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert server.wait_idle().num_running == 0


async def test_the_context_check_is_the_decode_workers(server, auth) -> None:
    """At the limit exactly: accepted by both (the prompt plus max_tokens fill the context)."""
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.post(server.url + "/tokenize", json={"prompt": LONG}) as response:
            count = (await response.json())["count"]
        for max_tokens, status in ((MAX_MODEL_LEN - count, 200), (MAX_MODEL_LEN - count + 1, 400)):
            body = {"model": MODEL_NAME, "prompt": LONG, "max_tokens": max_tokens,
                    "kv_transfer_params": _leg(f"t-edge-{max_tokens}")}
            async with session.post(server.url + C, json=body) as response:
                assert response.status == status, await response.text()
