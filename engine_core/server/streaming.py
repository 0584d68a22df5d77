"""Server-sent events: ``data: <json>`` chunks ending with ``data: [DONE]``, each write to the
client bounded in time (``WriteBound``, ``--write-timeout``)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import sys
import termios
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web


class ClientStalledError(ConnectionResetError):
    """The client took no bytes within the write bound and its connection was aborted: a
    ConnectionResetError, so whatever handles a client that left handles this one too."""


def _kernel_send_queue(transport: asyncio.BaseTransport) -> int:
    """Bytes in the socket's kernel send queue (Linux SIOCOUTQ); 0 where unknown."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(termios, "TIOCOUTQ"):
        return 0
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int.from_bytes(queued, sys.byteorder)


@dataclass(frozen=True)
class WriteBound:
    """How long a write to a streaming client may go without the client taking a byte
    (``--write-timeout``), and what to call with the request when one did (log, count)."""

    timeout_s: float
    on_stall: Callable[[web.Request], None]


class SSEStream:
    """An open response stream whose writes give up once the client took no bytes for
    ``bound.timeout_s``.

    A client that stops reading but stays connected fills its TCP window, and aiohttp's
    write then waits in its drain until the client reads again: unbounded, that held the
    handler, the connection and whatever the request holds upstream (engine requests and
    KV blocks; on the proxy, its admission slot and the decode leg) for as long as the
    client stayed. A watchdog, not a deadline per write: it looks at the unsent bytes every
    half bound of a waiting write, and while they shrink the client is still reading
    (slowly: one write may carry hundreds of KB); only when nothing drained for a whole
    bound (two looks in a row) is the connection aborted (not closed: a close first flushes
    the unsent bytes, the very wait being ended). That ends the request as a client that
    left does: the handler is cancelled (or, without handler cancellation, the write raises
    ``ClientStalledError``). A loop timer, not ``wait_for``: every chunk of every stream
    pays it, and ``wait_for`` makes a task each time (Python 3.11).
    """

    def __init__(self, request: web.Request, response: web.StreamResponse,
                 bound: WriteBound) -> None:
        self.request = request
        self.response = response
        self.bound = bound
        self.stalled = False
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._last_unsent: int | None = None  # at the watchdog's last look
        self._quiet = 0  # looks in a row with nothing taken

    async def write(self, data: bytes) -> None:
        """``response.write``; ``ClientStalledError`` when the client stopped taking bytes."""
        await self._send(data, eof=False)

    async def write_eof(self) -> None:
        """``response.write_eof`` (it drains too), bounded alike."""
        await self._send(b"", eof=True)

    async def _send(self, data: bytes, eof: bool) -> None:
        self._raise_if_stalled()  # the connection is gone: no second wait
        # Nothing measured here (every chunk of every stream passes): the watchdog looks at
        # the unsent bytes only once a write has waited half a bound.
        self._last_unsent, self._quiet = None, 0
        self._timer = self._loop.call_later(self.bound.timeout_s / 2, self._check)
        try:
            await (self.response.write_eof(data) if eof else self.response.write(data))
        except ConnectionError:
            if not self.stalled:
                raise
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._raise_if_stalled()

    def _unsent(self) -> int:
        """Bytes written and not yet taken by the client: the transport's buffer plus the
        kernel's send queue (where the client's progress shows first: the transport only
        refills a large kernel buffer once much of it has drained)."""
        transport = self.request.transport
        if transport is None:
            return 0
        return transport.get_write_buffer_size() + _kernel_send_queue(transport)

    def _check(self) -> None:
        """Every half bound of a waiting write: re-arm while the client takes bytes; after
        two looks in a row with nothing taken (a whole bound) abort its connection, which
        wakes the write."""
        unsent = self._unsent()
        if self._last_unsent is None or unsent < self._last_unsent:
            self._last_unsent, self._quiet = unsent, 0
        else:
            self._quiet += 1
        if self._quiet < 2:
            self._timer = self._loop.call_later(self.bound.timeout_s / 2, self._check)
            return
        self._timer = None
        self.stalled = True
        self.bound.on_stall(self.request)
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    def _raise_if_stalled(self) -> None:
        if self.stalled:
            raise ClientStalledError(f"the client took no bytes for {self.bound.timeout_s:g} s")


async def start_sse(request: web.Request, bound: WriteBound,
                    headers: dict[str, str] | None = None) -> SSEStream:
    """Send the SSE response headers; chunks follow with ``send_event``."""
    response = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "Connection": "keep-alive", **(headers or {})})
    await response.prepare(request)
    return SSEStream(request, response, bound)


# An event's output token ids, for the proxy only (``Handoff.stream_token_ids``): an SSE
# comment line, which a client that is sent it unstripped ignores.
TOKEN_IDS_COMMENT = b": pdserve_token_ids="


def token_ids_comment(token_ids: list[int]) -> bytes:
    """The comment line naming the output tokens the event after it completes."""
    return TOKEN_IDS_COMMENT + ",".join(map(str, token_ids)).encode() + b"\n"


def encode_event(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def send_event(stream: SSEStream, data: dict[str, Any]) -> None:
    await stream.write(encode_event(data))


async def send_done(stream: SSEStream) -> None:
    await stream.write(encode_event("[DONE]"))
    await stream.write_eof()
