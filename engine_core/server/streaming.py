"""Server-sent events: ``data: <json>`` chunks ending with ``data: [DONE]``, each write to the
client bounded in time (``WriteBound``, ``--write-timeout``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine_core.server.http_errors import REQUEST_ID_KEY

logger = logging.getLogger("pdserve.server")


class ClientStalledError(ConnectionResetError):
    """The client took no bytes within the write bound and its connection was aborted: a
    ConnectionResetError, so whatever handles a client that left handles this one too."""


@dataclass(frozen=True)
class WriteBound:
    """How long one write to a streaming client may wait (``ServerOptions.write_timeout_s``),
    and what to call when one did not finish in time (a metric)."""

    timeout_s: float
    on_stall: Callable[[], None]


class SSEStream:
    """An open event stream whose every write waits at most ``bound.timeout_s``.

    A client that stops reading but stays connected fills its TCP window, and aiohttp's
    write then waits in its drain until the client reads again: unbounded, that held the
    handler, the connection and the stream's engine requests (their KV blocks) for as long
    as the client stayed. Past the bound the connection is aborted, not closed (a close
    first flushes the unsent bytes: the very wait being ended), which ends the request as
    a client that left does: the handler is cancelled (or, without handler cancellation,
    the write raises ``ClientStalledError``) and leaving it aborts the engine requests.
    A loop timer per write, not ``wait_for``: every chunk of every stream pays it, and
    ``wait_for`` makes a task each time (Python 3.11).
    """

    def __init__(self, request: web.Request, response: web.StreamResponse,
                 bound: WriteBound) -> None:
        self.request = request
        self.response = response
        self.bound = bound
        self.stalled = False
        self._loop = asyncio.get_running_loop()

    async def write(self, data: bytes) -> None:
        """``response.write``; ``ClientStalledError`` when the client did not take it in time."""
        await self._send(data, eof=False)

    async def write_eof(self) -> None:
        """``response.write_eof`` (it drains too), bounded alike."""
        await self._send(b"", eof=True)

    async def _send(self, data: bytes, eof: bool) -> None:
        self._raise_if_stalled()  # the connection is gone: no second wait
        timer = self._loop.call_later(self.bound.timeout_s, self._give_up)
        try:
            await (self.response.write_eof(data) if eof else self.response.write(data))
        except ConnectionError:
            if not self.stalled:
                raise
        finally:
            timer.cancel()
        self._raise_if_stalled()

    def _raise_if_stalled(self) -> None:
        if self.stalled:
            raise ClientStalledError(f"the client took no bytes for {self.bound.timeout_s:g} s")

    def _give_up(self) -> None:
        """The write still waits at the bound: abort the connection, which wakes it."""
        self.stalled = True
        self.bound.on_stall()
        logger.warning("request %s: the client took no bytes for %g s (not reading); its "
                       "connection is closed and its engine requests aborted",
                       self.request.get(REQUEST_ID_KEY, "-"), self.bound.timeout_s)
        transport = self.request.transport
        if transport is not None:
            transport.abort()


async def start_sse(request: web.Request, bound: WriteBound,
                    headers: dict[str, str] | None = None) -> SSEStream:
    """Send the SSE response headers; chunks follow with ``send_event``."""
    response = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "Connection": "keep-alive", **(headers or {})})
    await response.prepare(request)
    return SSEStream(request, response, bound)


def encode_event(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def send_event(stream: SSEStream, data: dict[str, Any]) -> None:
    await stream.write(encode_event(data))


async def send_done(stream: SSEStream) -> None:
    await stream.write(encode_event("[DONE]"))
    await stream.write_eof()
