"""Reading a request's JSON body, for the workers and the proxy alike.

A body is refused by its declared length before any of it is read, read in chunks up to
the cap (a chunked or decompressed body has no trustworthy length), within a deadline,
and joined once: a worker's memory stays flat whatever a client sends. A large body is
parsed off the event loop (``json_parser``). A body that cannot be decoded (a broken
``Content-Encoding``, invalid UTF-8, malformed JSON) is a 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from engine_core.errors import InvalidRequestError, RequestTimeoutError, RequestTooLargeError
from engine_core.server.json_parser import JsonParser


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole (decoded) body, at most ``max_bytes``, all of it within ``timeout_s``."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise RequestTooLargeError(f"request body of {declared} bytes exceeds the limit of "
                                   f"{max_bytes} bytes")
    try:
        return await asyncio.wait_for(_read_capped(request, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeoutError(f"request body not received in full within {timeout_s:g} s"
                                  ) from None
    except web.RequestPayloadError as exc:  # a broken gzip/deflate stream or chunk framing
        raise InvalidRequestError(f"request body cannot be decoded: {exc.__cause__ or exc}"
                                  ) from None


async def _read_capped(request: web.Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLargeError(f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_body(request: web.Request, max_bytes: int, timeout_s: float,
                         parser: JsonParser) -> dict[str, Any]:
    """The body as a JSON object (``read_body``'s bounds; 400 when it is not one), parsed
    by ``parser`` (off the loop when large)."""
    return await parser.parse(await read_body(request, max_bytes, timeout_s))
