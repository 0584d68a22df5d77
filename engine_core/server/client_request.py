"""What the server reads of a client's HTTP request before any engine work: its request id,
and whether its client is still there."""

from __future__ import annotations

import uuid

from aiohttp import web

from engine_core.errors import InvalidRequestError

_MAX_REQUEST_ID_LEN = 256


def request_id_of(request: web.Request) -> str:
    """The client's ``X-Request-Id`` when given (the proxy's transfer id), else a fresh one."""
    given = request.headers.get("X-Request-Id", "").strip()
    if not given:
        return uuid.uuid4().hex
    if len(given) > _MAX_REQUEST_ID_LEN or not given.isprintable():
        raise InvalidRequestError("X-Request-Id must be printable and at most "
                                  f"{_MAX_REQUEST_ID_LEN} characters", "X-Request-Id")
    return given


def check_client_connected(request: web.Request) -> None:
    """Refuse to start engine work for a client already gone.

    aiohttp cancels a running handler when its connection closes, which aborts its engine
    requests; but a connection that closed before the handler started (a proxy that sent
    a leg and abandoned it at once, say after its prefill worker died) cancels nothing, and
    a decode request waiting for remote KV writes nothing that would fail: it stayed in
    the engine, holding blocks, until its load timed out and it was recomputed for nobody."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client closed its connection before the request "
                                   "started")
