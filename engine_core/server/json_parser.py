"""Request bodies to JSON objects without stalling the event loop, for workers and the proxy.

``json.loads`` holds the GIL for the whole body (about 100 ms for 10 MB on a busy core),
so parsing a large body on a thread stalls the loop as much as parsing it inline. A body
above ``off_loop_bytes`` is therefore parsed in a child process (``json_parse_child``, one
per server, started at the first large body, restarted if it dies), one body at a time; the
loop only copies the bytes out and the parsed value back in (``marshal``, written by our own
child from JSON values). Smaller bodies parse inline, where a thread hop would cost more.
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import sys
from pathlib import Path
from typing import Any

from engine_core.errors import InvalidRequestError
from engine_core.server import json_parse_child as child
from engine_core.server.protocol import parse_json

logger = logging.getLogger(__name__)

DEFAULT_OFF_LOOP_BYTES = 1 << 20  # ~10 ms of parsing inline at most


class JsonParser:
    """Parses request bodies; explicit ``close``. One per server (its app owns it)."""

    def __init__(self, off_loop_bytes: int = DEFAULT_OFF_LOOP_BYTES) -> None:
        self.off_loop_bytes = off_loop_bytes
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self.parsed_off_loop = 0  # bodies the child parsed (tests, stats)

    async def parse(self, raw: bytes) -> dict[str, Any]:
        """The body as a JSON object; InvalidRequestError (400) when it is not one."""
        if len(raw) <= self.off_loop_bytes:
            return parse_json(raw)
        async with self._lock:  # one body at a time: the child answers in order
            try:
                status, payload = await self._exchange(raw)
            except (OSError, asyncio.IncompleteReadError, ConnectionError) as exc:
                logger.warning("json parser process failed (%s): parsing this body inline", exc)
                await self._stop()
                return parse_json(raw)
        if status != child.PARSED:
            raise InvalidRequestError(payload.decode(errors="replace"))
        self.parsed_off_loop += 1
        body = marshal.loads(payload)
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        return body

    async def _exchange(self, raw: bytes) -> tuple[int, bytes]:
        process = await self._started()
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(child.FRAME.pack(len(raw)))
        process.stdin.write(raw)
        await process.stdin.drain()
        status, size = child.STATUS.unpack(await process.stdout.readexactly(child.STATUS.size))
        return status, await process.stdout.readexactly(size)

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is None or self._process.returncode is not None:
            # -I: isolated (no site-packages, no PYTHONPATH): the child is standard library only.
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", str(Path(child.__file__)),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return self._process

    async def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 2.0)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()

    async def close(self) -> None:
        """Stop the child (it also exits on its own when this process dies: end of input)."""
        async with self._lock:
            await self._stop()
