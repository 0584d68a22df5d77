"""The aiohttp runner every HTTP server of the cluster (workers and proxy) listens with.

On top of aiohttp's own connection handling it adds two rules:

- A deadline for the request line and headers (``--header-timeout``): it runs from the
  connection's opening, and from the first byte of each later request on it; a client
  that has not sent a whole request head by then gets a 408 and its connection is closed,
  so clients trickling headers a byte at a time cannot hold connections.
- aiohttp's own parser errors (a bad request line, oversized headers, a bad method) are
  answered in the JSON error style of ``http_errors``, not as plain text.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from engine_core.server.http_errors import error_response

logger = logging.getLogger("pdserve.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0


class _ParserError(web.HTTPError):
    """An aiohttp parser error as an HTTP exception, for ``http_errors.error_response``."""

    def __init__(self, status: int, message: str) -> None:
        self.status_code = status
        super().__init__(text=message)


class _HeaderTimeout(Exception):
    """The request head did not arrive within the deadline."""


class EdgeRequestHandler(RequestHandler):
    """aiohttp's connection protocol with a request-head deadline and JSON parser errors."""

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        # Waiting for the next request (not reading a body): its first byte starts the clock.
        if self._head_deadline is None and self._waiter is not None:
            self._arm_head_deadline()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a whole head arrived
            self._disarm_head_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._head_deadline = asyncio.get_running_loop().call_later(
            self._header_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        logger.info("closing a connection whose request head took over %g s",
                    self._header_timeout_s)
        # No response is under way (the head is unfinished): the 408 goes out as raw bytes.
        response = error_response(_ParserError(
            408, f"request line and headers not received within {self._header_timeout_s:g} s"))
        body = response.body if isinstance(response.body, bytes) else b""
        transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        self.force_close()
        transport.close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's parser errors (and anything escaping the middlewares) as JSON."""
        if status >= 500:
            logger.error("error handling a request from %s", request.remote, exc_info=exc)
            message = "internal server error"
        else:  # a malformed request: the client's fault, common on an open port
            logger.debug("malformed request from %s: %s", request.remote, message)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already under way; cannot send the error")
        response = error_response(_ParserError(status, message or "malformed request"))
        response.force_close()
        return response


class _EdgeServer(web.Server):
    """aiohttp's low-level server making ``EdgeRequestHandler`` connections."""

    def __init__(self, base: web.Server, header_timeout_s: float) -> None:
        # base._kwargs: the connection settings aiohttp's runner gathered (keep-alive, log).
        super().__init__(base.request_handler, request_factory=base.request_factory,
                         handler_cancellation=base.handler_cancellation, **base._kwargs)
        self._header_timeout_s = header_timeout_s

    def __call__(self) -> RequestHandler:
        return EdgeRequestHandler(self, loop=self._loop, header_timeout_s=self._header_timeout_s,
                                  **self._kwargs)


class EdgeAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections follow this module's rules."""

    def __init__(self, app: web.Application, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        return _EdgeServer(await super()._make_server(), self._header_timeout_s)
