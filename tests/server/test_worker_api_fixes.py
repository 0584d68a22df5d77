"""A worker's answers vLLM gives too: requests sharing an X-Request-Id all served, /ping,
engine rejections naming their parameter, aborted requests counted as finished by
"abort"."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.test_metrics import _scrape

C = "/v1/completions"


async def test_requests_sharing_an_x_request_id_are_all_served(server, auth) -> None:
    """The header names the request in answers and logs; the engine id adds a unique
    suffix, so concurrent ones no longer get "already in flight" (vLLM serves them)."""
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 20, "ignore_eos": True}
    headers = {**auth, "X-Request-Id": "trace-123"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async def one(stream: bool) -> tuple[int, str, dict | str]:
            async with session.post(server.url + C, json={**body, "stream": stream}) as response:
                answer = await (response.text() if stream else response.json())
                return response.status, response.headers.get("X-Request-Id", ""), answer

        results = await asyncio.gather(*(one(i % 2 == 1) for i in range(6)))
    for status, request_id, answer in results:
        assert status == 200, answer
        assert request_id == "trace-123"
        if isinstance(answer, dict):
            assert answer["id"] == "cmpl-trace-123"
            assert answer["usage"]["completion_tokens"] == 20
        else:
            assert '"cmpl-trace-123"' in answer and answer.endswith("data: [DONE]\n\n")
    assert server.wait_idle().num_running == 0


async def test_a_client_leaving_aborts_its_request_under_a_shared_id(server, auth) -> None:
    """The abort of a request that left reaches its own engine request (by the suffixed
    id) and not the one that shares its X-Request-Id."""
    headers = {**auth, "X-Request-Id": "shared"}
    long = {"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    short = {"model": MODEL_NAME, "prompt": "a short one", "max_tokens": 30, "ignore_eos": True}
    async with aiohttp.ClientSession(headers=headers) as session:
        leaving = await session.post(server.url + C, json=long)
        assert leaving.status == 200
        await leaving.content.readline()
        staying = asyncio.ensure_future(session.post(server.url + C, json=short))
        await asyncio.sleep(0.05)
        leaving.close()
        response = await staying
        assert response.status == 200
        assert (await response.json())["usage"]["completion_tokens"] == 30
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.num_free_blocks == server.initial_free_blocks


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_ping_is_health(server, method: str) -> None:
    """SageMaker's health check as vLLM serves it (no API key, as /health)."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, server.url + "/ping") as response:
            assert response.status == 200


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"100000": 5}), ("stop_token_ids", [100000]),
    ("allowed_token_ids", [100000])])
async def test_engine_rejections_name_their_parameter(server, auth, field, value) -> None:
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, field: value}
    async with aiohttp.ClientSession(headers=auth) as session:
        for stream in (False, True):
            async with session.post(server.url + C, json={**body, "stream": stream}) as response:
                assert response.status == 400
                error = (await response.json())["error"]
            assert error["param"] == field, error
            assert "must be in [0," in error["message"]


async def test_a_client_leaving_is_no_finished_request(server, auth) -> None:
    """vLLM V1 declares "abort" among the finished reasons (present at 0 from the start) but
    a request its client left is dropped from the output processor without finished-request
    stats; so here: neither request_success nor the per-request histograms move."""
    before = _scrape(server.url)
    assert "vllm:request_success_total{abort}" in before
    body = {"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(headers=auth) as session:
        responses = [await session.post(server.url + C, json=body) for _ in range(3)]
        for response in responses:
            assert response.status == 200
            await response.content.readline()
        for response in responses:
            response.close()
    assert server.wait_idle().num_running == 0
    after = _scrape(server.url)
    for key in ("vllm:request_success_total{abort}", "vllm:request_success_total{stop}",
                "vllm:request_success_total{length}", "vllm:e2e_request_latency_seconds_count",
                "vllm:request_generation_tokens_count"):
        assert after.get(key) == before.get(key), key
    # A refused request is no finished one either.
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.post(server.url + C, json={"prompt": "hi", "n": 0}) as response:
            assert response.status == 400
    final = _scrape(server.url)
    for reason in ("stop", "length", "abort"):
        key = f"vllm:request_success_total{{{reason}}}"
        assert final.get(key) == after.get(key), reason
    assert server.wait_idle().num_running == 0


async def test_max_tokens_param_is_observed_for_a_request_without_one(server, auth) -> None:
    """vLLM records the effective limit (the rest of the context when the client gave none)
    for every finished request; it was skipped for a chat request without max_tokens."""
    before = _scrape(server.url)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.0}
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.post(server.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.json()
    after = _scrape(server.url)
    key = "vllm:request_params_max_tokens_count"
    assert after[key] == before[key] + 1
    assert after["vllm:request_params_max_tokens_sum"] > before["vllm:request_params_max_tokens_sum"]
