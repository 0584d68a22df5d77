"""Clients that send their request slowly, or stop mid-way (slowloris), against the proxy.

A raw asyncio socket plays the client, so the test controls every byte and every pause:
aiohttp's own client always sends a body whole.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine_core.errors import ConfigError
from proxy import keys
from proxy.__main__ import add_proxy_args, config_from_args
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.registry import InstanceRegistry

MODEL = "tiny"
BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 8}).encode()
BODY_TIMEOUT_S = 0.4
# What a test server lingers after answering a request whose body it did not read
# (aiohttp's lingering close; 10 s by default), kept short so a test sees the close.
LINGERING_S = 0.3

ProxyFactory = Callable[..., Awaitable[TestClient]]


@pytest.fixture
async def start_proxy() -> AsyncIterator[ProxyFactory]:
    """A proxy with the given workers and config overrides, its server's own settings
    (``lingering_time``, ``keepalive_timeout``) passed to aiohttp as ``server``."""
    clients: list[TestClient] = []

    async def factory(*workers: Any, server: dict[str, Any] | None = None,
                      **overrides: Any) -> TestClient:
        config = ProxyConfig(**{"registration_port": None, "body_timeout_s": BODY_TIMEOUT_S,
                                **overrides})
        registry = InstanceRegistry(config.heartbeat_timeout_s, config.suspect_s)
        for worker in workers:
            registry.heartbeat(worker.heartbeat())
        test_server = TestServer(create_app(config, registry=registry))
        await test_server.start_server(**{"lingering_time": LINGERING_S, **(server or {})})
        client = TestClient(test_server)
        await client.start_server()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()


async def _connect(client: TestClient) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(client.server.host, client.server.port)


def _head(length: int | None, path: str = "/v1/completions") -> bytes:
    """Request line and headers; ``length`` None: a chunked body."""
    framing = (f"Content-Length: {length}" if length is not None
               else "Transfer-Encoding: chunked")
    return (f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n").encode()


async def _read_response(reader: asyncio.StreamReader,
                         timeout_s: float) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one Content-Length response."""
    async def read() -> tuple[int, dict[str, str], bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return int(status_line.split()[1]), headers, body

    return await asyncio.wait_for(read(), timeout_s)


def _sample(client: TestClient, line_start: str) -> float:
    """The value of the /metrics line starting with ``line_start`` (0 when absent)."""
    text = client.server.app[keys.METRICS].render().decode()
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _limiter_count(client: TestClient) -> int:
    return client.server.app[keys.LIMITER].count


def _check_408(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 408, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "request_timeout"
    assert error["type"] == "invalid_request_error"
    assert f"{BODY_TIMEOUT_S:g}" in error["message"]
    assert headers.get("connection", "").lower() == "close"


async def _still_serves(client: TestClient) -> None:
    resp = await client.post("/v1/completions", data=BODY,
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["served_by"] == "D"


async def test_stalled_body_is_408_within_the_bound_and_frees_its_slot(
        make_worker, start_proxy, wait_until) -> None:
    """Headers and half a body, then silence: before the bound the request held the one
    admission slot for good (every other request got a 429)."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await start_proxy(p, d, max_inflight=1)
    reader, writer = await _connect(client)
    started = time.monotonic()
    writer.write(_head(len(BODY)) + BODY[:len(BODY) // 2])
    await writer.drain()
    await wait_until(lambda: _limiter_count(client) == 1)
    status, headers, body = await _read_response(reader, timeout_s=BODY_TIMEOUT_S + 3.0)
    elapsed = time.monotonic() - started
    _check_408(status, headers, body)
    assert BODY_TIMEOUT_S * 0.9 <= elapsed < BODY_TIMEOUT_S + 2.0
    assert _limiter_count(client) == 0
    assert _sample(client, "pdserve:proxy_in_flight_requests ") == 0
    assert _sample(client, 'pdserve:proxy_rejected_requests_total{reason="body_timeout"}') == 1
    assert _sample(client, 'pdserve:proxy_requests_total{endpoint="/v1/completions",'
                           'status="408"}') == 1
    assert p.received == [] and d.received == []  # nothing of it reached a worker
    # The connection is closed after the lingering close, not held by the silent client.
    assert await asyncio.wait_for(reader.read(), LINGERING_S + 3.0) == b""
    writer.close()
    await _still_serves(client)  # max_inflight 1: the slot came back


async def test_a_trickling_body_is_bounded_in_total_not_per_read(
        make_worker, start_proxy, wait_until) -> None:
    """A chunked body sent a byte at a time and never ended: every read succeeds, so only a
    bound on the whole body stops it."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await start_proxy(p, d, max_inflight=1)
    reader, writer = await _connect(client)
    writer.write(_head(None))
    await writer.drain()
    started = time.monotonic()

    async def trickle() -> None:
        for byte in BODY * 1000:
            writer.write(b"1\r\n" + bytes([byte]) + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)

    trickler = asyncio.create_task(trickle())
    try:
        status, headers, body = await _read_response(reader, timeout_s=BODY_TIMEOUT_S + 3.0)
    finally:
        trickler.cancel()
        await asyncio.gather(trickler, return_exceptions=True)
    assert time.monotonic() - started < BODY_TIMEOUT_S + 2.0
    _check_408(status, headers, body)
    writer.close()
    await wait_until(lambda: _limiter_count(client) == 0)
    await _still_serves(client)


async def test_many_stalled_clients_all_time_out_and_the_proxy_serves_on(
        make_worker, start_proxy, wait_until) -> None:
    """Every slot taken by a silent upload: all are answered 408 and given back."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await start_proxy(p, d, max_inflight=4)
    conns = [await _connect(client) for _ in range(4)]
    for _, writer in conns:
        writer.write(_head(len(BODY)) + BODY[:5])
        await writer.drain()
    await wait_until(lambda: _limiter_count(client) == 4)
    refused = await client.post("/v1/completions", data=BODY)
    assert refused.status == 429  # the slots are really taken while the bodies are read
    answers = await asyncio.gather(*(_read_response(reader, BODY_TIMEOUT_S + 3.0)
                                     for reader, _ in conns))
    for status, headers, body in answers:
        _check_408(status, headers, body)
    assert _limiter_count(client) == 0
    assert _sample(client, 'pdserve:proxy_rejected_requests_total{reason="body_timeout"}') == 4
    for _, writer in conns:
        writer.close()
    await _still_serves(client)


async def test_a_slow_body_within_the_bound_is_served(make_worker, start_proxy) -> None:
    """The bound is on the whole body: a client that pauses but finishes in time is served."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await start_proxy(p, d, body_timeout_s=3.0)
    reader, writer = await _connect(client)
    writer.write(_head(len(BODY)))
    for i in range(0, len(BODY), 8):
        writer.write(BODY[i:i + 8])
        await writer.drain()
        await asyncio.sleep(0.02)
    status, _, body = await _read_response(reader, timeout_s=5.0)
    assert status == 200, body
    assert json.loads(body)["served_by"] == "D"
    writer.close()


async def test_a_client_leaving_mid_body_gives_its_slot_back(
        make_worker, start_proxy, wait_until) -> None:
    p, d = await make_worker("P"), await make_worker("D")
    client = await start_proxy(p, d, max_inflight=1, body_timeout_s=60.0)
    _, writer = await _connect(client)
    writer.write(_head(len(BODY)) + BODY[:5])
    await writer.drain()
    await wait_until(lambda: _limiter_count(client) == 1)
    writer.close()
    await wait_until(lambda: _limiter_count(client) == 0)
    assert _sample(client, "pdserve:proxy_in_flight_requests ") == 0
    await _still_serves(client)


async def test_stalled_headers_take_no_slot_and_are_closed_by_the_keepalive_timer(
        make_worker, start_proxy, wait_until) -> None:
    """Before its headers are complete a request is aiohttp's alone: no handler, no slot.
    What ends it is aiohttp's keep-alive timer (``keepalive_timeout``: 75 s under
    ``pdserve proxy``'s ``web.run_app``), shortened here."""
    p, d = await make_worker("P"), await make_worker("D")
    client = await start_proxy(p, d, max_inflight=1, server={"keepalive_timeout": 0.5})
    reader, writer = await _connect(client)
    writer.write(_head(len(BODY))[:30])
    await writer.drain()
    await asyncio.sleep(0.1)
    assert _limiter_count(client) == 0
    await _still_serves(client)
    assert await asyncio.wait_for(reader.read(), 3.0) == b""
    writer.close()


def test_body_timeout_config_and_flag() -> None:
    assert ProxyConfig().body_timeout_s == 30.0
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="body_timeout_s"):
            ProxyConfig(body_timeout_s=bad)
    parser = add_proxy_args(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args([])).body_timeout_s == 30.0
    assert config_from_args(parser.parse_args(["--body-timeout", "7.5"])).body_timeout_s == 7.5
