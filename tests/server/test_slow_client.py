"""A client that sends its request slowly must not hold the worker's resources for good:
the whole body within ``--body-timeout`` (else 408, OpenAI error body, connection closed),
and unfinished headers or an idle connection closed after the keep-alive timeout (aiohttp's
AppRunner default is an hour)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from tests.server.conftest import ServerHandle, demo_engine_config

BODY_TIMEOUT_S = 1.0
KEEPALIVE_S = 1.5


@pytest.fixture(scope="module")
def impatient_server(demo_checkpoint: Path) -> ServerHandle:
    from engine_core.server.api_server import ServerOptions

    config = demo_engine_config(demo_checkpoint, max_num_seqs=8)
    options = ServerOptions(log_stats_interval_s=0, body_timeout_s=BODY_TIMEOUT_S,
                            keepalive_timeout_s=KEEPALIVE_S)
    handle = ServerHandle(config, options)
    yield handle
    handle.stop()


def _read_response(sock: socket.socket, limit_s: float) -> tuple[bytes, bytes, float]:
    """The head and body of one response (by its Content-Length), and when it was complete.
    (After a 408 aiohttp still drains the unsent body for a while before it closes.)"""
    sock.settimeout(limit_s)
    started, data = time.monotonic(), b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body, time.monotonic() - started


def _closed_within(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closed the connection (recv returns b"")."""
    sock.settimeout(limit_s)
    started = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - started


def _completes(server: ServerHandle) -> bool:
    request = urllib.request.Request(
        server.url + "/v1/completions", method="POST",
        data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"})
    body = json.loads(urllib.request.urlopen(request, timeout=60).read())
    return body["usage"]["completion_tokens"] == 2


def test_a_stalled_body_gets_408_and_its_connection_closed(impatient_server) -> None:
    with socket.create_connection(("127.0.0.1", impatient_server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"prompt":')
        head, body, waited = _read_response(sock, 10 * BODY_TIMEOUT_S)
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout"
    assert "within 1 s" in error["message"]
    assert BODY_TIMEOUT_S * 0.9 <= waited < BODY_TIMEOUT_S + 5
    assert _completes(impatient_server)  # the worker serves on


def test_unfinished_headers_are_closed_after_the_keepalive_timeout(impatient_server) -> None:
    with socket.create_connection(("127.0.0.1", impatient_server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        waited = _closed_within(sock, 10 * KEEPALIVE_S)
    assert waited < KEEPALIVE_S + 5, waited
    assert _completes(impatient_server)


def test_the_body_timeout_flag() -> None:
    import argparse

    from engine_core.server.server_args import add_server_arguments, server_options

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert server_options(parser.parse_args([])).body_timeout_s == 30.0
    assert server_options(parser.parse_args(["--body-timeout", "7.5"])).body_timeout_s == 7.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--body-timeout", bad])
