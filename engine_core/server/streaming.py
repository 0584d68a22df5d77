"""Server-sent events: ``data: <json>`` chunks ending with ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


async def start_sse(request: web.Request, headers: dict[str, str] | None = None
                    ) -> web.StreamResponse:
    """Send the SSE response headers; chunks follow with ``send_event``."""
    response = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "Connection": "keep-alive", **(headers or {})})
    await response.prepare(request)
    return response


def encode_event(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                            separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def send_event(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(encode_event(data))


async def send_done(response: web.StreamResponse) -> None:
    await response.write(encode_event("[DONE]"))
    await response.write_eof()
