"""HTTP edges every server of the cluster shares: the API key rule, the capped body reader,
the request-head deadline and JSON parser errors (``EdgeAppRunner``).

Small aiohttp apps over the real middlewares and runner: no engine, so these run in
milliseconds; the worker and proxy apps wire the same pieces (test_bad_input.py and
tests/proxy/test_proxy_api_key.py check them there).
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from engine_core.server.api_key import api_key_middleware
from engine_core.server.http_errors import error_middleware
from engine_core.server.http_runner import EdgeAppRunner
from engine_core.server.json_parser import JsonParser
from engine_core.server.request_body import read_json_body

KEY = "edge-key"
BODY_LIMIT = 1 << 16
HEADER_TIMEOUT_S = 0.5


@web.middleware
async def _remote_from_header(request: web.Request, handler) -> web.StreamResponse:
    """Tests only: a client address other than loopback, as ``X-Test-Remote`` names it."""
    remote = request.headers.get("X-Test-Remote")
    return await handler(request.clone(remote=remote) if remote else request)


async def _echo(request: web.Request) -> web.Response:
    body = await read_json_body(request, BODY_LIMIT, timeout_s=30.0, parser=JsonParser())
    return web.json_response({"keys": sorted(body)})


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def _app(api_key: str | None) -> web.Application:
    app = web.Application(middlewares=[error_middleware, _remote_from_header,
                                       api_key_middleware(api_key, ("/sleep",))])
    app.router.add_post("/v1/completions", _echo)
    app.router.add_get("/health", _ok)
    app.router.add_get("/metrics", _ok)
    app.router.add_post("/sleep", _ok)
    return app


class _Server:
    def __init__(self, runner: web.AppRunner, port: int) -> None:
        self.runner, self.port = runner, port

    async def raw(self, data: bytes, timeout_s: float = 10.0) -> bytes:
        """Send raw bytes; the server's first response (head and body)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(data)
        await writer.drain()
        try:
            return await asyncio.wait_for(_read_response(reader), timeout_s)
        finally:
            writer.close()

    async def request(self, method: str, path: str, headers: dict[str, str] | None = None,
                      body: bytes = b"") -> tuple[int, dict]:
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head += f"Content-Length: {len(body)}\r\n\r\n"
        return _parse(await self.raw(head.encode() + body))


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


def _parse(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), answer
    return status, json.loads(body)


async def _serve(api_key: str | None) -> AsyncIterator[_Server]:
    runner = EdgeAppRunner(_app(api_key), header_timeout_s=HEADER_TIMEOUT_S, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield _Server(runner, site._server.sockets[0].getsockname()[1])
    await runner.cleanup()


@pytest.fixture
async def keyed() -> AsyncIterator[_Server]:
    async for server in _serve(KEY):
        yield server


@pytest.fixture
async def keyless() -> AsyncIterator[_Server]:
    async for server in _serve(None):
        yield server


AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}


# ---- the API key ---------------------------------------------------------------------------

async def test_a_key_guards_every_route_but_the_probes(keyed: _Server) -> None:
    body = b'{"prompt": "hi"}'
    for path, method in (("/v1/completions", "POST"), ("/metrics", "GET"), ("/sleep", "POST"),
                         ("/nothing", "GET")):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            status, answer = await keyed.request(method, path, headers, body)
            assert status == 401, (path, headers)
            assert "API key" in answer["error"]["message"]
    assert (await keyed.request("POST", "/v1/completions", AUTH, body))[0] == 200
    assert (await keyed.request("GET", "/metrics", AUTH))[0] == 200
    assert (await keyed.request("POST", "/sleep", AUTH))[0] == 200
    assert (await keyed.request("GET", "/nothing", AUTH))[0] == 404
    assert (await keyed.request("GET", "/health"))[0] == 200


async def test_admin_routes_need_the_key_always(keyless: _Server, keyed: _Server) -> None:
    """Without a key set, admin routes answer loopback clients only; with one, the key is
    needed from anywhere (loopback too)."""
    remote = {"X-Test-Remote": "10.1.2.3"}
    assert (await keyless.request("POST", "/sleep"))[0] == 200
    status, answer = await keyless.request("POST", "/sleep", remote)
    assert status == 401 and "loopback" in answer["error"]["message"]
    assert (await keyless.request("GET", "/metrics", remote))[0] == 200
    assert (await keyed.request("POST", "/sleep", remote))[0] == 401
    assert (await keyed.request("POST", "/sleep", {**remote, **AUTH}))[0] == 200


# ---- bodies --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,headers,body", [
    ("broken gzip", {"Content-Encoding": "gzip"}, b"this is not gzip"),
    ("truncated gzip", {"Content-Encoding": "gzip"}, gzip.compress(b'{"prompt": "hi"}', mtime=0)[:12]),
    ("invalid utf-8", {}, b'{"prompt": "\xff\xfe"}'),
    ("not json", {}, b"prompt=hi"),
    ("json but not an object", {}, b'["hi"]'),
])
async def test_an_undecodable_body_is_a_400(keyed: _Server, name: str, headers: dict,
                                            body: bytes) -> None:
    status, answer = await keyed.request("POST", "/v1/completions", {**AUTH, **JSON, **headers},
                                         body)
    assert status == 400, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}


async def test_a_gzip_body_is_decoded(keyed: _Server) -> None:
    status, answer = await keyed.request("POST", "/v1/completions",
                                         {**AUTH, **JSON, "Content-Encoding": "gzip"},
                                         gzip.compress(b'{"prompt": "hi"}'))
    assert (status, answer) == (200, {"keys": ["prompt"]})


async def test_an_oversized_body_is_refused_by_its_declared_length(keyed: _Server) -> None:
    """Refused from the headers alone: nothing of the body is sent, yet the answer comes."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {BODY_LIMIT + 1}\r\n\r\n").encode()
    status, answer = _parse(await keyed.raw(head))
    assert status == 413 and str(BODY_LIMIT) in answer["error"]["message"]


async def test_a_chunked_body_past_the_cap_is_refused(keyed: _Server) -> None:
    chunk = b"x" * 4096
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(BODY_LIMIT // 4096 + 2))
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    status, _ = _parse(await keyed.raw(head + chunks + b"0\r\n\r\n"))
    assert status == 413


# ---- the request head ----------------------------------------------------------------------

async def test_headers_trickled_past_the_deadline_get_a_408(keyed: _Server) -> None:
    """A client sending its headers a byte at a time is cut off at --header-timeout (here
    0.5 s); without the deadline it held the connection for as long as it kept sending."""
    reader, writer = await asyncio.open_connection("127.0.0.1", keyed.port)
    writer.write(b"GET /health HTTP/1.1\r\n")
    answer = None
    for _ in range(200):  # 20 s of trickling at most
        writer.write(b"X")
        try:  # the answer, if it came while this byte went out (never write after it)
            answer = await asyncio.wait_for(_read_response(reader), 0.1)
            break
        except asyncio.TimeoutError:
            continue
    writer.close()
    assert answer is not None, "the connection was never cut off"
    status, body = _parse(answer)
    assert status == 408 and "headers" in body["error"]["message"]


async def test_the_deadline_spares_idle_keepalive_and_slow_bodies(keyed: _Server) -> None:
    """The deadline covers request heads only: a keep-alive connection idle between requests
    and a body sent slowly after its headers are not cut off by it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", keyed.port)
    body = b'{"prompt": "hi"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for piece_s in (HEADER_TIMEOUT_S / 2, 0.0):  # a slow body, then a quick one
        writer.write(head)
        for piece in (body[:4], body[4:8], body[8:12], body[12:]):  # slow: 2 x the deadline
            await asyncio.sleep(piece_s)
            writer.write(piece)
        status_line = await asyncio.wait_for(reader.readline(), 10)
        assert status_line.startswith(b"HTTP/1.1 200"), status_line
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        await asyncio.sleep(2 * HEADER_TIMEOUT_S)  # idle before the next request
    writer.close()


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
], ids=["bad request line", "oversized header", "bad version"])
async def test_parser_errors_are_json(keyed: _Server, raw: bytes) -> None:
    status, body = _parse(await keyed.raw(raw))
    assert 400 <= status < 500
    assert set(body["error"]) == {"message", "type", "param", "code"}
