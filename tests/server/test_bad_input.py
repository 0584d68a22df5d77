"""Malformed requests get the right status and an OpenAI-style error body, never a crash."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.server.conftest import API_KEY, BODY_LIMIT, MAX_MODEL_LEN, MODEL_NAME

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]
LONG_PROMPT = list(range(10, 10 + MAX_MODEL_LEN + 5))

CASES = [
    ("malformed json", C, b"{not json", 400),
    ("json array body", C, [1, 2], 400),
    ("json string body", C, "prompt", 400),
    ("missing prompt", C, {"model": MODEL_NAME}, 400),
    ("empty prompt", C, {"prompt": ""}, 400),
    ("empty prompt list", C, {"prompt": []}, 400),
    ("prompt wrong type", C, {"prompt": 5}, 400),
    ("negative token id", C, {"prompt": [1, -2]}, 400),
    ("token id beyond vocab", C, {"prompt": [1, 10_000_000]}, 400),
    ("prompt longer than context", C, {"prompt": LONG_PROMPT}, 400),
    ("max_tokens zero", C, {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens beyond context", C, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400),
    ("max_tokens wrong type", C, {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("temperature negative", C, {"prompt": "hi", "temperature": -0.5}, 400),
    ("temperature wrong type", C, {"prompt": "hi", "temperature": "hot"}, 400),
    ("top_p zero", C, {"prompt": "hi", "top_p": 0}, 400),
    ("top_p above one", C, {"prompt": "hi", "top_p": 1.5}, 400),
    ("unknown model", C, {"prompt": "hi", "model": "gpt-9"}, 404),
    ("n zero", C, {"prompt": "hi", "n": 0}, 400),
    ("too many choices", C, {"prompt": ["hi"] * 9, "n": 128}, 400),
    ("n too large", C, {"prompt": "hi", "n": 129}, 400),
    ("generated_token_ids not one list per choice", C, {"prompt": "hi", "n": 2,
                                                        "kv_transfer_params": {
                                                            "generated_token_ids": [[1]]}}, 400),
    ("logprobs too many", C, {"prompt": "hi", "logprobs": 50}, 400),
    ("logprobs wrong type", C, {"prompt": "hi", "logprobs": "yes"}, 400),
    ("stream wrong type", C, {"prompt": "hi", "stream": "yes"}, 400),
    ("stream_options without stream", C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("unsupported parameter", C, {"prompt": "hi", "use_beam_search": True}, 400),
    ("prompt_logprobs too many", C, {"prompt": "hi", "prompt_logprobs": 21}, 400),
    ("prompt_logprobs wrong type", C, {"prompt": "hi", "prompt_logprobs": "3"}, 400),
    ("prompt_logprobs streamed", C, {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
     400),
    ("best_of", C, {"prompt": "hi", "best_of": 3}, 400),
    ("echo wrong type", C, {"prompt": "hi", "echo": "yes"}, 400),
    ("stop wrong type", C, {"prompt": "hi", "stop": 3}, 400),
    ("presence_penalty out of range", C, {"prompt": "hi", "presence_penalty": 5}, 400),
    ("kv_transfer_params wrong type", C, {"prompt": "hi", "kv_transfer_params": "x"}, 400),
    ("generated_token_ids wrong type", C, {"prompt": "hi", "kv_transfer_params": {
        "generated_token_ids": "7"}}, 400),
    ("generated_token_ids bool", C, {"prompt": "hi", "kv_transfer_params": {
        "generated_token_ids": [[True]]}}, 400),
    ("generated_token_ids flat", C, {"prompt": "hi", "kv_transfer_params": {
        "generated_token_ids": [1]}}, 400),
    ("generated_token_ids no choice", C, {"prompt": "hi", "kv_transfer_params": {
        "generated_token_ids": []}}, 400),
    ("generated_token_ids negative", C, {"prompt": "hi", "kv_transfer_params": {
        "generated_token_ids": [[-1]]}}, 400),
    ("generated_token_ids beyond vocab", C, {"prompt": "hi", "kv_transfer_params": {
        "generated_token_ids": [[10_000_000]]}}, 400),
    ("generated_token_ids beyond max_tokens", C, {"prompt": "hi", "max_tokens": 1,
                                                  "kv_transfer_params": {
                                                      "generated_token_ids": [[1, 2]]}}, 400),
    ("generated_token_ids with a prompt batch", C, {"prompt": ["a", "b"], "kv_transfer_params": {
        "generated_token_ids": [[1]]}}, 400),
    ("first_token_events checks the client's max_tokens", C, {
        "prompt": "hi", "max_tokens": MAX_MODEL_LEN, "kv_transfer_params": {
            "first_token_events": True}}, 400),
    ("first_token_events wrong type", C, {"prompt": "hi", "kv_transfer_params": {
        "first_token_events": "yes"}}, 400),
    ("first_token_events with generated_token_ids", C, {"prompt": "hi", "kv_transfer_params": {
        "first_token_events": True, "generated_token_ids": [[1]]}}, 400),
    ("logit_bias not an object", C, {"prompt": "hi", "logit_bias": [1, 2]}, 400),
    ("logit_bias key not a token id", C, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400),
    ("logit_bias negative token id", C, {"prompt": "hi", "logit_bias": {"-3": 1}}, 400),
    ("logit_bias token beyond vocab", C, {"prompt": "hi", "logit_bias": {"10000000": 1}}, 400),
    ("logit_bias value out of range", C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400),
    ("logit_bias value not a number", CHAT, {"messages": OK_MSG, "logit_bias": {"5": "up"}}, 400),
    ("logit_bias too many tokens", C, {"prompt": "hi", "logit_bias": {
        str(i): 1 for i in range(1025)}}, 400),
    ("allowed_token_ids empty", C, {"prompt": "hi", "allowed_token_ids": []}, 400),
    ("allowed_token_ids not a list", C, {"prompt": "hi", "allowed_token_ids": 5}, 400),
    ("allowed_token_ids negative", C, {"prompt": "hi", "allowed_token_ids": [-1]}, 400),
    ("allowed_token_ids beyond vocab", CHAT, {"messages": OK_MSG,
                                              "allowed_token_ids": [10_000_000]}, 400),
    ("stop_token_ids beyond vocab with min_tokens", C, {
        "prompt": "hi", "max_tokens": 3, "min_tokens": 1, "stop_token_ids": [1_000_000_000]}, 400),
    ("stop_token_ids beyond int64", C, {"prompt": "hi", "stop_token_ids": [1 << 63]}, 400),
    ("seed beyond int64", C, {"prompt": "hi", "seed": 1 << 64}, 400),
    ("top_k beyond int64", C, {"prompt": "hi", "top_k": 1 << 64}, 400),
    ("min_tokens beyond int64", CHAT, {"messages": OK_MSG, "min_tokens": 1 << 64}, 400),
    ("logit_bias key beyond int64", C, {"prompt": "hi", "logit_bias": {str(1 << 64): 1}}, 400),
    ("allowed_token_ids beyond int64", C, {"prompt": "hi", "allowed_token_ids": [1 << 64]}, 400),
    ("allowed_token_ids too many", C, {"prompt": "hi", "allowed_token_ids": [5] * 1025}, 400),
    ("stop string too long", C, {"prompt": "hi", "stop": ["x" * 1025]}, 400),
    ("nesting deeper than the recursion limit", C,
     b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("integer of 5000 digits", C, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400),
    ("NaN temperature", C, b'{"prompt": "hi", "temperature": NaN}', 400),
    ("Infinity temperature", C, b'{"prompt": "hi", "temperature": Infinity}', 400),
    ("NaN repetition_penalty", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
                                     b'"repetition_penalty": NaN}', 400),
    ("lone surrogate in the prompt", C, b'{"prompt": "a\\ud800b"}', 400),
    ("lone surrogate to tokenize", "/tokenize", b'{"prompt": "a\\ud800b"}', 400),
    # Session 20's review: each of these was a 500 (float() or msgpack failing on them), or
    # sampled token 0 (a temperature beyond float32 became inf on the device).
    *[(f"huge integer {key}", C, b'{"prompt": "hi", "' + key.encode() + b'": 1'
       + b"0" * 400 + b"}", 400)
      for key in ("temperature", "top_p", "presence_penalty", "repetition_penalty")],
    ("huge integer chat min_p", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
                                      b'"min_p": 1' + b"0" * 400 + b"}", 400),
    ("huge integer logit_bias", C, b'{"prompt": "hi", "logit_bias": {"5": 1' + b"0" * 400
     + b"}}", 400),
    ("temperature beyond float32", C, {"prompt": "hi", "temperature": 1e300}, 400),
    ("repetition_penalty that float32 rounds to zero", C,
     {"prompt": "hi", "repetition_penalty": 1e-300}, 400),
    ("lone surrogate in a stop string", C, b'{"prompt": "hi", "stop": ["\\ud800"]}', 400),
    ("lone surrogate in a chat stop string", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "stop": "x\\udfff"}', 400),
    ("lone surrogate in kv_transfer_params", C,
     b'{"prompt": "hi", "kv_transfer_params": {"x": "\\ud800"}}', 400),
    ("integer past 64 bits in kv_transfer_params", C,
     b'{"prompt": "hi", "kv_transfer_params": {"x": ' + b"9" * 30 + b"}}", 400),
    ("kv_transfer_params 600 deep", C, b'{"prompt": "hi", "kv_transfer_params": '
     + b'{"a":' * 600 + b"1" + b"}" * 600 + b"}", 400),
    ("truncate_prompt_tokens zero", C, {"prompt": "hi", "truncate_prompt_tokens": 0}, 400),
    ("truncate_prompt_tokens wrong type", CHAT, {"messages": OK_MSG,
                                                 "truncate_prompt_tokens": "5"}, 400),
    ("chat missing messages", CHAT, {"model": MODEL_NAME}, 400),
    ("chat empty messages", CHAT, {"messages": []}, 400),
    ("chat unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("chat message not object", CHAT, {"messages": ["hi"]}, 400),
    ("chat content wrong type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    ("chat image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
    ("chat top_logprobs without logprobs", CHAT, {"messages": OK_MSG, "top_logprobs": 2}, 400),
    ("chat logprobs wrong type", CHAT, {"messages": OK_MSG, "logprobs": 3}, 400),
    ("chat tools", CHAT, {"messages": OK_MSG, "tools": [{"type": "function"}]}, 400),
    ("chat max_completion_tokens negative", CHAT, {"messages": OK_MSG, "max_completion_tokens": -1}, 400),
    ("chat unknown model", CHAT, {"messages": OK_MSG, "model": "nope"}, 404),
    ("unknown route", "/v1/nothing", {}, 404),
    ("tokenize missing prompt", "/tokenize", {}, 400),
    ("detokenize bad tokens", "/detokenize", {"tokens": ["a"]}, 400),
]


def _check_error_body(body: dict, status: int) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["code"] is None or isinstance(error["code"], str)


@pytest.mark.parametrize("name,path,body,status", CASES, ids=[c[0] for c in CASES])
async def test_bad_request(server, auth, name, path, body, status):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + path, data=data, headers=auth) as response:
            assert response.status == status, await response.text()
            _check_error_body(await response.json(), status)


async def test_auth_size_method_and_health(server, auth):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            async with session.post(server.url + C, data=body, headers=headers) as response:
                assert response.status == 401
                _check_error_body(await response.json(), 401)
        big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode()
        async with session.post(server.url + C, data=big, headers=auth) as response:
            assert response.status == 413
            _check_error_body(await response.json(), 413)
        async with session.get(server.url + C, headers=auth) as response:
            assert response.status == 405
            _check_error_body(await response.json(), 405)
        # Admin endpoints do not exist unless enabled.
        async with session.post(server.url + "/reset_prefix_cache", headers=auth) as response:
            assert response.status == 404
        async with session.get(server.url + "/health") as response:
            assert response.status == 200
        async with session.get(server.url + "/version", headers=auth) as response:
            assert "version" in await response.json()
        async with session.post(server.url + "/tokenize", json={"prompt": "hello"},
                                headers=auth) as response:
            tokens = (await response.json())["tokens"]
            assert tokens
        async with session.post(server.url + "/detokenize", json={"tokens": tokens},
                                headers=auth) as response:
            assert (await response.json())["prompt"] == "hello"
        async with session.post(server.url + C, data=body, headers=auth) as response:
            assert response.status == 200


def test_no_block_leaked_after_bad_input(server):
    stats = server.wait_idle()
    assert stats.num_free_blocks == server.initial_free_blocks
    assert stats.num_running == 0 and stats.num_waiting == 0
