"""Many concurrent streams complete with correct usage; disconnected clients free their blocks."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from tests.server.conftest import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def _stream(session: aiohttp.ClientSession, url: str, index: int, max_tokens: int) -> dict:
    body = {"prompt": f"Request number {index} says", "max_tokens": max_tokens,
            "temperature": 0.7, "seed": index, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = []
    async with session.post(url + "/v1/completions", json=body, headers=HEADERS) as response:
        assert response.status == 200
        async for line in response.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
            if line == "data: [DONE]":
                break
    usage = chunks[-1]["usage"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    return {"usage": usage, "finish": finish, "text": "".join(
        c["choices"][0]["text"] for c in chunks if c["choices"])}


async def test_200_concurrent_streams(server):
    max_tokens = 8
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(*[_stream(session, server.url, i, max_tokens)
                                         for i in range(200)])
    for result in results:
        assert result["finish"] == "length"
        assert result["usage"]["completion_tokens"] == max_tokens
        assert result["usage"]["total_tokens"] == (result["usage"]["prompt_tokens"] + max_tokens)
    stats = await asyncio.get_running_loop().run_in_executor(None, server.wait_idle)
    assert stats.num_free_blocks == server.initial_free_blocks


async def test_disconnect_50_clients_frees_blocks(server):
    body = {"prompt": "A long story begins", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    sessions = [aiohttp.ClientSession() for _ in range(50)]
    responses = []
    try:
        responses = await asyncio.gather(*[
            session.post(server.url + "/v1/completions", json=body, headers=HEADERS)
            for session in sessions])
        for response in responses:
            assert response.status == 200
            await response.content.readline()  # the first chunk arrived: mid-stream now
        stats = await asyncio.get_running_loop().run_in_executor(None, server.stats)
        assert stats.num_running > 0 and stats.num_free_blocks < server.initial_free_blocks
    finally:
        for response in responses:
            response.close()
        for session in sessions:
            await session.close()
    stats = await asyncio.get_running_loop().run_in_executor(None, server.wait_idle)
    assert stats.num_running == 0
    assert stats.num_free_blocks == server.initial_free_blocks
    async with aiohttp.ClientSession() as session:
        async with session.get(server.url + "/health") as response:
            assert response.status == 200


async def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing(server, auth):
    """Four /tokenize calls of ~1 MB each (seconds of tokenizer work) while /v1/models is
    asked ten times: each prompt has more characters than the context can hold tokens of,
    so it is a 400 at once, and the other answers come at once."""
    body = json.dumps({"prompt": "hello world, the quick brown fox " * 30000}).encode()
    async with aiohttp.ClientSession(headers=auth) as session:
        async def tokenize() -> None:
            async with session.post(server.url + "/tokenize", data=body) as response:
                assert response.status == 400
                assert "characters" in (await response.json())["error"]["message"]

        async def slowest_models_answer() -> float:
            await asyncio.sleep(0.05)
            slowest = 0.0
            for _ in range(10):
                started = time.monotonic()
                async with session.get(server.url + "/v1/models") as response:
                    await response.read()
                slowest = max(slowest, time.monotonic() - started)
            return slowest

        *_, slowest = await asyncio.gather(*(tokenize() for _ in range(4)),
                                           slowest_models_answer())
    assert slowest < 0.5, f"/v1/models waited {slowest:.2f} s behind tokenization"
