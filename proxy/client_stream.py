"""The client's open stream: once its headers went out, an error can only end it.

``open_stream`` records the stream on the request; ``end_open_stream`` (the handlers'
error path) and ``end_stream`` end it with an SSE error event instead of a second response.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from engine_core.server.http_errors import sse_error_event
from engine_core.server.streaming import SSEStream, WriteBound

logger = logging.getLogger("proxy.dispatcher")


OPEN_STREAM: Any = (web.RequestKey("open_stream", SSEStream)
                    if hasattr(web, "RequestKey") else "pdserve_open_stream")


async def open_stream(request: web.Request, out: web.StreamResponse,
                       bound: WriteBound) -> SSEStream:
    """Send the client stream's headers, and record it on the request: from then on an error
    can only end it (``end_open_stream``), never replace it with an error response. Its
    writes give up once the client took no bytes for ``bound.timeout_s``."""
    await out.prepare(request)
    stream = SSEStream(request, out, bound)
    request[OPEN_STREAM] = stream
    return stream


async def end_open_stream(request: web.Request, exc: BaseException) -> web.StreamResponse | None:
    """End the request's open client stream with an SSE error event for ``exc``; None when
    no stream was opened (the caller answers with an error status instead)."""
    stream = request.get(OPEN_STREAM)
    if stream is None:
        return None
    return await end_stream(stream, exc)


async def end_stream(stream: SSEStream, err: BaseException) -> web.StreamResponse:
    """End a client stream whose bytes went out with an SSE error event (the upstream, or
    the proxy itself, failed before sending its own); a blank line first closes any event
    left half-written."""
    logger.warning("stream ended with an error after the first token: %s", err)
    try:
        await stream.write(b"\n\n" + sse_error_event(err))
        await stream.write_eof()
    except (ConnectionResetError, RuntimeError):  # the client left, or the stream had ended
        pass
    return stream.response

