"""Clients that stop reading a streamed answer while staying connected.

Such a client's receive window fills, and then the proxy's next write to it waits until it
reads again: without a bound, for as long as it stays connected, holding the request's
admission slot and D's leg (D's request and KV blocks) all that time. A raw asyncio socket
plays the client, its receive buffer set small before connecting so the window fills fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from engine_core.errors import ConfigError
from proxy import keys
from proxy.__main__ import add_proxy_args, config_from_args
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.registry import InstanceRegistry

WRITE_TIMEOUT_S = 0.4
BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}).encode()
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
SMALL_WINDOW = 4096
STALL_METRIC = "pdserve:proxy_client_write_timeouts_total "

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class ProxyServer:
    app: web.Application
    host: str
    port: int


@pytest.fixture
async def serve_proxy() -> AsyncIterator[Callable[..., Awaitable[ProxyServer]]]:
    """A proxy with the given workers, served with or without handler cancellation:
    ``pdserve proxy`` runs with it (a client that leaves cancels the handler), aiohttp's
    ``web.run_app`` defaults to without (only the next write to that client fails)."""
    runners: list[web.AppRunner] = []

    async def factory(*workers: Any, handler_cancellation: bool = True,
                      **overrides: Any) -> ProxyServer:
        # D computes the first token unless a test turns the handoff (the default) on.
        config = ProxyConfig(**{"registration_port": None, "first_token_from_prefill": False,
                                **overrides})
        registry = InstanceRegistry(config.heartbeat_timeout_s, config.suspect_s)
        for worker in workers:
            registry.heartbeat(worker.heartbeat())
        app = create_app(config, registry=registry)
        runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return ProxyServer(app, host, port)

    yield factory
    for runner in runners:
        await runner.cleanup()


async def _small_window_client(proxy: ProxyServer) -> Stream:
    """A connection whose receive window stays tiny: SO_RCVBUF set before connecting (it
    then fixes the window the proxy sees) and a StreamReader that stops taking bytes from
    the socket past a few KiB."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_WINDOW)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (proxy.host, proxy.port))
    return await asyncio.open_connection(sock=sock, limit=SMALL_WINDOW)


async def _start_stream(stream: Stream) -> bytes:
    """Send the streaming request and read the response head and the body's first chunk
    (decoded)."""
    reader, writer = stream
    writer.write(REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    return await asyncio.wait_for(_read_chunk(reader), 5.0)


async def _read_chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body, without its framing (b"" for the last one)."""
    size = int((await reader.readline()).strip(), 16)
    return (await reader.readexactly(size + 2))[:-2]


async def _read_chunked_body(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """The rest of a chunked body, decoded, up to its last (zero-size) chunk."""
    async def read() -> bytes:
        body = bytearray()
        while chunk := await _read_chunk(reader):
            body += chunk
        return bytes(body)

    return await asyncio.wait_for(read(), timeout_s)


async def _read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Read whatever is left until the connection ends (FIN or reset)."""
    async def drain() -> None:
        try:
            while await reader.read(1 << 16):
                pass
        except ConnectionResetError:
            pass

    await asyncio.wait_for(drain(), timeout_s)


def _sample(app: web.Application, line_start: str) -> float:
    """The value of the /metrics line starting with ``line_start`` (0 when absent)."""
    for line in app[keys.METRICS].render().decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _legs_in_flight(app: web.Application) -> int:
    return sum(w["in_flight"] for w in app[keys.REGISTRY].snapshot())


async def _still_serves(proxy: ProxyServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{proxy.host}:{proxy.port}/v1/completions",
                                data=BODY.replace(b"true", b"false"),
                                headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()


@pytest.mark.parametrize(("handler_cancellation", "handoff"),
                         [(True, False), (False, False), (True, True)],
                         ids=["cancelling", "not-cancelling", "first-token-handoff"])
async def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(
        make_worker, serve_proxy, wait_until, handler_cancellation: bool,
        handoff: bool) -> None:
    """Reads the first bytes, then nothing while D streams on: the proxy's write to it
    waited for good, holding the one slot and D's request. Past the bound the proxy closes
    the client's connection and D's leg (D aborts the request) and frees the slot."""
    p, d = await make_worker("P"), await make_worker("D", "flood")
    proxy = await serve_proxy(p, d, handler_cancellation=handler_cancellation,
                              first_token_from_prefill=handoff, max_inflight=1,
                              write_timeout_s=WRITE_TIMEOUT_S)
    limiter = proxy.app[keys.LIMITER]
    stream = await _small_window_client(proxy)
    started = time.monotonic()
    first = await _start_stream(stream)
    assert (b'"P0"' in first) == handoff  # P's token went out first, D's stream after it
    assert limiter.count == 1
    await wait_until(lambda: limiter.count == 0, timeout_s=WRITE_TIMEOUT_S + 3.0)
    assert time.monotonic() - started >= WRITE_TIMEOUT_S  # it waited for the bound first
    await wait_until(lambda: d.cancelled == [d.received[0]["request_id"]])
    await wait_until(lambda: _legs_in_flight(proxy.app) == 0)
    assert _sample(proxy.app, STALL_METRIC) == 1
    assert _sample(proxy.app, "pdserve:proxy_in_flight_requests ") == 0
    await _read_until_closed(stream[0], timeout_s=3.0)
    stream[1].close()
    await _still_serves(proxy)  # max_inflight 1: the slot came back


async def test_a_client_that_pauses_within_the_bound_gets_the_whole_stream(
        make_worker, serve_proxy) -> None:
    """The bound is on one write, not on the stream: a reader that pauses for less than it,
    its window full meanwhile, then reads on, gets every event and the end."""
    p, d = await make_worker("P"), await make_worker("D", "flood", flood_bytes=8 << 20)
    proxy = await serve_proxy(p, d, write_timeout_s=1.5)
    stream = await _small_window_client(proxy)
    first = await _start_stream(stream)
    await asyncio.sleep(0.3)
    body = first + await _read_chunked_body(stream[0], timeout_s=20.0)
    stream[1].close()
    assert body.endswith(b"data: [DONE]\n\n")
    event_bytes = len(body.split(b"\n\n", 1)[0]) + 2
    assert body.count(b"data: {") == (8 << 20) // event_bytes  # every event D sent
    assert _sample(proxy.app, STALL_METRIC) == 0
    assert d.cancelled == []


def test_write_timeout_config_and_flag() -> None:
    assert ProxyConfig().write_timeout_s == 60.0
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="write_timeout_s"):
            ProxyConfig(write_timeout_s=bad)
    parser = add_proxy_args(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args([])).write_timeout_s == 60.0
    assert config_from_args(parser.parse_args(["--write-timeout", "2.5"])).write_timeout_s == 2.5


async def test_a_whole_answer_to_a_client_that_does_not_read_is_bounded_too(
        make_worker, serve_proxy, wait_until) -> None:
    """A non-streamed answer of many MB that the client never reads: the proxy writes it
    under the same bound (aiohttp's own write after the handler would wait for good,
    holding the connection and the body) and drops the client past it."""
    p, d = await make_worker("P"), await make_worker("D", "flood", flood_bytes=16 << 20)
    proxy = await serve_proxy(p, d, write_timeout_s=WRITE_TIMEOUT_S)
    reader, writer = await _small_window_client(proxy)
    body = BODY.replace(b"true", b"false")
    writer.write(REQUEST.split(b"Content-Length")[0] + b"Content-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
    assert head.startswith(b"HTTP/1.1 200"), head
    await wait_until(lambda: _sample(proxy.app, STALL_METRIC) == 1,
                     timeout_s=WRITE_TIMEOUT_S + 5.0)
    await _read_until_closed(reader, timeout_s=5.0)
    writer.close()
    assert _sample(proxy.app, "pdserve:proxy_in_flight_requests ") == 0
    await _still_serves(proxy)
