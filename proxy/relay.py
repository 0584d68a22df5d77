"""Relaying a worker's answer to the client: a refusal passed on or retried, a whole body
written under the write bound, a stream opened and handed to ``_stream_into``
(``proxy/migration.py``), and the timing headers the proxy adds.

A mixin of ``Dispatcher``. A streaming client that takes no bytes for ``write_timeout_s``
(it stopped reading) has its connection aborted (``engine_core.server.streaming.SSEStream``),
counted and logged here.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from engine_core.errors import UpstreamError, UpstreamUnavailableError
from engine_core.server.streaming import ClientStalledError, SSEStream, WriteBound
from proxy import forwarding as fw
from proxy.client_stream import open_stream
from proxy.legs import Leg, RequestTimer, Retry, breakdown_headers, proxy_overhead
from proxy.migration import Migrate

if TYPE_CHECKING:
    from proxy.dispatcher import Dispatcher

logger = logging.getLogger("proxy.dispatcher")


class ClientRelay:
    """``Dispatcher``'s side of the client's response."""

    async def _forward_refusal(self: Dispatcher, response: aiohttp.ClientResponse, leg: Leg,
                               attempt_id: str) -> web.StreamResponse:
        """Pass a worker's 4xx on unchanged; a 503 (asleep, or not ready) is tried again
        on another worker; any other 5xx becomes a 502 with an error body."""
        data = await fw.read_body(response, self.max_response_bytes)
        if response.status == 503:
            err = UpstreamUnavailableError(
                f"{leg.role} worker {leg.worker.worker_id} is unavailable: "
                f"{data[:300].decode(errors='replace')}")
            leg.finish(err)
            raise Retry(leg.worker, err, f"{leg.role}_unavailable")
        if response.status < 500:
            leg.finish()
            return web.Response(status=response.status, body=data,
                                content_type=response.content_type,
                                headers={"X-Request-Id": attempt_id})
        err = UpstreamError(f"{leg.role} worker {leg.worker.worker_id} answered "
                            f"{response.status}: {data[:500].decode(errors='replace')}",
                            kind="status", status=response.status)
        leg.finish(err)
        raise Migrate(leg.worker, err, f"{leg.role}_status")

    async def _relay(self: Dispatcher, request: web.Request, response: aiohttp.ClientResponse, leg: Leg,
                     attempt_id: str, timer: RequestTimer) -> web.StreamResponse:
        if not fw.is_event_stream(response):
            try:
                data = await fw.read_body(response, self.max_response_bytes)
            except UpstreamError as err:
                leg.finish(err)
                raise Migrate(leg.worker, err, f"{leg.role}_{err.kind}") from None
            timer.first_byte = timer.upstream_done = self.clock()
            if not data:
                err = UpstreamError(f"{leg.role} worker {leg.worker.worker_id} answered an "
                                    "empty body", kind="empty")
                leg.finish(err)
                raise Migrate(leg.worker, err, f"{leg.role}_empty")
            leg.finish()
            headers = {"X-Request-Id": attempt_id, **self._timing_headers(timer)}
            return await self._send_whole(request, response.status, data,
                                          response.content_type, headers)
        first = b""
        try:
            first = await self._read_event_chunk(response)
        except UpstreamError as err:
            leg.finish(err)
            raise Migrate(leg.worker, err, f"{leg.role}_{err.kind}") from None
        if not first:
            err = UpstreamError(f"{leg.role} worker {leg.worker.worker_id} ended its stream "
                                "before any event", kind="empty")
            leg.finish(err)
            raise Migrate(leg.worker, err, f"{leg.role}_empty")
        timer.first_byte = self.clock()
        leg.prefill_done()  # a whole request's first token: its prompt is computed
        out = web.StreamResponse(status=response.status, headers={
            "Content-Type": fw.SSE_CONTENT_TYPE, "Cache-Control": "no-cache",
            "X-Request-Id": attempt_id, **breakdown_headers(timer)})
        stream = await self._open_stream(request, out)
        return await self._stream_into(stream, response, leg, attempt_id, timer, first)

    async def _send_whole(self: Dispatcher, request: web.Request, status: int, data: bytes,
                          content_type: str, headers: dict[str, str]) -> web.StreamResponse:
        """A whole answer written here under the write bound, as streams are (aiohttp's own
        final write, after the handler returned, waits without limit on a client that does
        not read, holding the connection and up to --max-response-bytes of body)."""
        out = web.StreamResponse(status=status, headers=headers)
        out.content_type = content_type
        out.content_length = len(data)
        stream = await self._open_stream(request, out)
        with contextlib.suppress(ClientStalledError):  # aborted, counted, logged
            await stream.write(data)
            await stream.write_eof()
        return out

    async def _open_stream(self: Dispatcher, request: web.Request,
                           out: web.StreamResponse) -> SSEStream:
        """``_open_stream`` with this proxy's write bound."""
        return await open_stream(request, out, WriteBound(self.write_timeout_s,
                                                           self._on_write_stall))

    def _on_write_stall(self: Dispatcher, request: web.Request) -> None:
        """A streaming client took no bytes for the write bound: count and log it (its
        connection is aborted, which closes the legs and frees the slot)."""
        self.metrics.client_write_timeouts.inc()
        logger.warning("request %s: the client took no bytes for %g s (not reading); its "
                       "connection is closed and the request aborted",
                       request.headers.get("X-Request-Id", "-"), self.write_timeout_s)

    def _timing_headers(self: Dispatcher, timer: RequestTimer) -> dict[str, str]:
        headers = breakdown_headers(timer)
        if timer.prefill_done is not None and timer.prefill_sent is not None:
            headers["X-Pdserve-Prefill-Ms"] = f"{(timer.prefill_done - timer.prefill_sent) * 1e3:.3f}"
        overhead = proxy_overhead(timer, self.clock())
        if overhead is not None:
            headers["X-Pdserve-Proxy-Overhead-Ms"] = f"{overhead * 1e3:.3f}"
        return headers
