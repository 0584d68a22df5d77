"""A streaming client that stops reading while staying connected must not hold the worker.

Its receive window fills, and then the server's next write to it waits until it reads
again: without a bound, for as long as it stays connected, holding the handler, the
connection and the engine requests with their KV blocks. A raw socket plays the client,
its receive buffer and MSS set small before connecting so that the buffers between it and
the server's writes fill after a few hundred KiB of events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from engine_core.server import streaming
from tests.server.conftest import MAX_MODEL_LEN, ServerHandle, demo_engine_config

WRITE_TIMEOUT_S = 2.0
STEP_DELAY_S = 0.02  # added to each engine step: MAX_TOKENS steps outlast the bound
SMALL_WINDOW = 4096
SMALL_MSS = 536
N = 16
MAX_TOKENS = MAX_MODEL_LEN - 16
# n samples with 20 top logprobs: ~0.8 KB of events a token, 13 KB a step; the buffers
# between the server's writes and this client (aiohttp's, both sockets') hold ~220 KB.
PAUSE_TOKENS = 600
STREAM = {"prompt": "hi", "max_tokens": MAX_TOKENS, "n": N, "logprobs": 20,
          "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
STALL_METRIC = "pdserve:client_write_timeouts_total "


def paced_engine_factory(config: Any) -> Any:
    """Runs in the engine process: the real engine, each step ``STEP_DELAY_S`` longer, so a
    stream of ``MAX_TOKENS`` takes well over the write bound on any machine (the stall test
    tells an aborted request from one that ran to its end)."""
    from engine_core.engine_core import EngineCore

    class PacedSteps(EngineCore):
        def step(self):  # type: ignore[no-untyped-def]
            time.sleep(STEP_DELAY_S)
            return super().step()

    return PacedSteps(config)


@pytest.fixture(scope="module")
def bounded_server(demo_checkpoint: Path) -> ServerHandle:
    from engine_core.server.api_server import ServerOptions

    config = demo_engine_config(demo_checkpoint)
    options = ServerOptions(log_stats_interval_s=0, write_timeout_s=WRITE_TIMEOUT_S)
    handle = ServerHandle(config, options, paced_engine_factory)
    yield handle
    handle.stop()


def _small_window_client(port: int) -> socket.socket:
    """A connection whose receive window stays tiny: SO_RCVBUF set before connecting fixes
    the window (and its scale) the server sees. A small MSS in its SYN as well: the server's
    send buffer is sized from the peer's MSS, and on loopback (64 KiB) it grows to
    tcp_wmem's maximum (4 MiB) at once, all of which would fill before a write waits."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_WINDOW)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, SMALL_MSS)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    return sock


def _start_stream(sock: socket.socket, body: dict[str, Any]) -> bytes:
    """Send a streaming completion; read its response head and first event, little more.
    Returns what was read of the (chunked) body."""
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: worker\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    received = b""
    while b"data: " not in received.partition(b"\r\n\r\n")[2]:
        chunk = sock.recv(1024)
        assert chunk, received
        received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"transfer-encoding: chunked" in head.lower()
    return rest


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything left until the server ends the connection (FIN or reset); a socket timeout
    (the connection stayed open) fails the test."""
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def _read_to_last_chunk(sock: socket.socket, received: bytes) -> bytes:
    """The rest of a chunked body, up to its last (zero-size) chunk."""
    while not received.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(1 << 16)
        assert chunk, received[-300:]
        received += chunk
    return received


def _dechunk(raw: bytes) -> bytes:
    body, rest = bytearray(), raw
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2:]


def _metric(server: ServerHandle, line_start: str) -> float:
    """The value of the /metrics line starting with ``line_start``."""
    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    line = next(line for line in text.splitlines() if line.startswith(line_start))
    return float(line.rsplit(" ", 1)[1])


def _wait_for_metric(server: ServerHandle, line_start: str, value: float,
                     timeout_s: float) -> float:
    """Seconds until the metric reached ``value`` (polled every 50 ms)."""
    started = time.monotonic()
    while _metric(server, line_start) != value:
        assert time.monotonic() - started < timeout_s, f"{line_start} never reached {value}"
        time.sleep(0.05)
    return time.monotonic() - started


def _pause(server: ServerHandle, generated: int, limit_s: float) -> None:
    """Read nothing until the engine's generated tokens reach ``generated`` (the stream is
    then far past what the buffers hold: the server's write waits) or ``limit_s`` passed."""
    deadline = time.monotonic() + limit_s
    while (time.monotonic() < deadline
           and server.stats().generation_tokens_total < generated):
        time.sleep(0.02)


def _completes(server: ServerHandle) -> bool:
    request = urllib.request.Request(
        server.url + "/v1/completions", method="POST",
        data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"})
    body = json.loads(urllib.request.urlopen(request, timeout=60).read())
    return body["usage"]["completion_tokens"] == 2


def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(
        bounded_server, caplog) -> None:
    """Reads the head and a first event, then nothing while the engine generates on: the
    server's write waited for good. Past the bound the server aborts the connection and the
    engine requests (freeing their KV blocks before they reach max_tokens), and counts it."""
    caplog.set_level(logging.WARNING, logger="pdserve.server")
    assert bounded_server.wait_idle().num_running == 0
    before = bounded_server.stats()
    assert _metric(bounded_server, STALL_METRIC) == 0
    with _small_window_client(bounded_server.port) as sock:
        _start_stream(sock, STREAM)
        # The bound, after the ~18 engine steps that fill the buffers (slack for a busy host).
        waited = _wait_for_metric(bounded_server, STALL_METRIC, 1,
                                  timeout_s=WRITE_TIMEOUT_S + 20)
        assert WRITE_TIMEOUT_S * 0.9 <= waited < WRITE_TIMEOUT_S + 10, waited
        sock.settimeout(10)
        rest = _read_until_closed(sock)  # what the server's socket held, then the end
    assert b"[DONE]" not in rest
    stats = bounded_server.wait_idle()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == bounded_server.initial_free_blocks
    # Aborted mid-way, not run to max_tokens by every sample.
    generated = stats.generation_tokens_total - before.generation_tokens_total
    assert 0 < generated < N * MAX_TOKENS, generated
    assert _metric(bounded_server, STALL_METRIC) == 1
    assert any(f"took no bytes for {WRITE_TIMEOUT_S:g} s" in r.getMessage()
               for r in caplog.records)
    assert _completes(bounded_server)  # the worker serves on


def test_a_non_streamed_answer_to_a_client_that_does_not_read_is_bounded_too(
        bounded_server) -> None:
    """n samples with logprobs make an answer of ~0.55 MB (a quarter of the stream's
    tokens; the buffers take 0.1-0.2 MB of it), written once the engine is done: a client that
    never reads it would hold the connection and the body for good (aiohttp's final write
    waits without limit); it is dropped after the bound, counted."""
    stalls = _metric(bounded_server, STALL_METRIC)
    body = {k: v for k, v in STREAM.items() if k not in ("stream", "stream_options")}
    body["max_tokens"] = MAX_TOKENS // 4
    data = json.dumps(body).encode()
    with _small_window_client(bounded_server.port) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: worker\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\n\r\n" + data)
        # The engine's generation (~1.5 s, paced), then the bound on the unread answer.
        _wait_for_metric(bounded_server, STALL_METRIC, stalls + 1,
                         timeout_s=WRITE_TIMEOUT_S + 40)
        sock.settimeout(10)
        rest = _read_until_closed(sock)
    head, _, answer = rest.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    assert len(answer) < length  # cut off, not delivered
    assert bounded_server.wait_idle().num_running == 0
    assert _completes(bounded_server)


def test_a_client_that_pauses_within_the_bound_gets_the_whole_stream(bounded_server) -> None:
    """The bound is on one write, not on the stream: a reader that pauses for less than it,
    its window full meanwhile, then reads on, gets every event and the end."""
    stalls = _metric(bounded_server, STALL_METRIC)
    # 960 tokens: past PAUSE_TOKENS, so the pause ends with the buffers full.
    body = {**STREAM, "max_tokens": MAX_TOKENS // 4}
    before = bounded_server.stats().generation_tokens_total
    with _small_window_client(bounded_server.port) as sock:
        first = _start_stream(sock, body)
        _pause(bounded_server, before + PAUSE_TOKENS, WRITE_TIMEOUT_S / 2)
        # Reads on at a usual pace: a window of a few KiB, its ACKs delayed, passes ~100 KB/s.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 18)
        raw = _read_to_last_chunk(sock, first)
    events = [e for e in _dechunk(raw).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == N * body["max_tokens"]
    finished = sorted(c["choices"][0]["index"] for c in chunks
                      if c["choices"] and c["choices"][0]["finish_reason"] == "length")
    assert finished == list(range(N))
    assert _metric(bounded_server, STALL_METRIC) == stalls
    assert bounded_server.wait_idle().num_running == 0


@pytest.mark.parametrize("handler_cancellation", [True, False],
                         ids=["cancelling", "not-cancelling"])
async def test_a_stalled_write_ends_the_handler_with_or_without_handler_cancellation(
        handler_cancellation: bool) -> None:
    """The worker's runner cancels the handler of a connection that is gone; an app served
    without that (``web.run_app``'s default) gets ``ClientStalledError`` from the stalled
    write instead. Either way the handler ends soon after the bound, counted once."""
    bound_s, stalls = 0.3, []
    ended: asyncio.Future[type[BaseException]] = asyncio.get_running_loop().create_future()

    async def endless(request: web.Request) -> web.StreamResponse:
        stream = await streaming.start_sse(
            request, streaming.WriteBound(bound_s, lambda _request: stalls.append(1)))
        try:
            while True:
                await streaming.send_event(stream, {"text": "x" * 4096})
        except streaming.ClientStalledError as exc:
            ended.set_result(type(exc))
            return stream.response
        except BaseException as exc:
            ended.set_result(type(exc))
            raise

    async with _served_to_a_small_window(endless, handler_cancellation,
                                         SMALL_WINDOW) as (reader, writer):
        started = asyncio.get_running_loop().time()
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
        how = await asyncio.wait_for(ended, 10)  # reading nothing more meanwhile
        waited = asyncio.get_running_loop().time() - started
        assert how is (asyncio.CancelledError if handler_cancellation
                       else streaming.ClientStalledError)
        assert bound_s <= waited < bound_s + 5 and stalls == [1]
        # What the server's socket held, then the end: the endless stream stopped for good.
        await asyncio.wait_for(_read_until_eof(reader), 5)


@contextlib.asynccontextmanager
async def _served_to_a_small_window(handler: Any, handler_cancellation: bool, limit: int
                                    ) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                             asyncio.StreamWriter]]:
    """``handler`` served at ``/`` by its own runner, and a client with a small receive
    window that has sent ``GET /`` (its reader and writer; closed and cleaned up after)."""
    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        sock = _small_window_client(runner.addresses[0][1])
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
        writer.write(b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n")
        try:
            yield reader, writer
        finally:
            writer.close()
    finally:
        await runner.cleanup()


async def _read_until_eof(reader: asyncio.StreamReader) -> None:
    """Read until the connection ends (FIN, or a reset)."""
    try:
        while await reader.read(1 << 16):
            pass
    except ConnectionResetError:
        pass


def test_the_write_timeout_option_and_flag() -> None:
    import argparse

    from engine_core.errors import ConfigError
    from engine_core.server.api_server import ServerOptions
    from engine_core.server.server_args import add_server_arguments, server_options

    assert ServerOptions().write_timeout_s == 60.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="write_timeout_s"):
            ServerOptions(write_timeout_s=bad)
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert server_options(parser.parse_args([])).write_timeout_s == 60.0
    assert server_options(parser.parse_args(["--write-timeout", "2.5"])).write_timeout_s == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--write-timeout", bad])


async def test_a_slow_but_steady_reader_is_not_cut_off() -> None:
    """The bound is on progress, not on one write: once the kernel's buffers are full, a
    1 MB write takes a client reading ~3 MB/s about 0.3 s, past a 0.1 s bound, yet it keeps
    taking bytes and gets the whole stream, no stall counted. (A deadline per write cut
    such clients off.)"""
    bound_s, chunk, chunks, stalls = 0.1, 1 << 20, 12, []

    async def big_writes(request: web.Request) -> web.StreamResponse:
        stream = await streaming.start_sse(
            request, streaming.WriteBound(bound_s, lambda _request: stalls.append(1)))
        for _ in range(chunks):
            await stream.write(b"x" * chunk)
        await stream.write_eof()
        return stream.response

    async with _served_to_a_small_window(big_writes, True, 32 << 10) as (reader, _writer):
        received = 0
        while received < chunk * chunks:  # the body, then chunked encoding's last lines
            data = await asyncio.wait_for(reader.read(32 << 10), 10)
            assert data, f"the connection ended after {received} bytes"
            received += len(data)
            await asyncio.sleep(0.01)  # at most ~3 MB/s
    assert stalls == []
