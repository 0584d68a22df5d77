"""Large request bodies are parsed off the event loop, with the inline parser's verdicts.

A real ``JsonParser`` and its child process; no server. "Off the loop" is checked by the
loop's own progress (a ticking task runs while a large body is parsed), never by timing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from engine_core.errors import InvalidRequestError
from engine_core.server.json_parser import JsonParser
from engine_core.server.protocol import parse_json

THRESHOLD = 1 << 10


def _big(value: Any) -> bytes:
    """A JSON body over the threshold holding ``value`` under "x"."""
    return json.dumps({"prompt": "w" * 4 * THRESHOLD, "x": value}).encode()


async def _parse(parser: JsonParser, raw: bytes) -> dict[str, Any]:
    try:
        return await parser.parse(raw)
    finally:
        await parser.close()


@pytest.mark.parametrize("value", [1, 1.5, "é\u2028 \\\"", [None, True, False, {"a": [2]}],
                                   10**100, -0.0])
def test_a_large_body_parses_as_inline(value: Any) -> None:
    parser = JsonParser(off_loop_bytes=THRESHOLD)
    raw = _big(value)
    assert asyncio.run(_parse(parser, raw)) == parse_json(raw)
    assert parser.parsed_off_loop == 1


@pytest.mark.parametrize("raw", [
    b'{"prompt": "' + b"w" * 4 * THRESHOLD + b'", "x": NaN}',
    b'{"prompt": "' + b"w" * 4 * THRESHOLD + b'"',
    b'["' + b"w" * 4 * THRESHOLD + b'"]',
    b'{"prompt": "' + b"\xff" * 4 * THRESHOLD + b'"}',
    b"[" * 4 * THRESHOLD,
], ids=["nan", "truncated", "not-an-object", "bad-utf8", "deep"])
def test_a_large_bad_body_is_a_400_as_inline(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        parse_json(raw)
    with pytest.raises(InvalidRequestError):
        asyncio.run(_parse(JsonParser(off_loop_bytes=THRESHOLD), raw))


def test_small_bodies_parse_inline() -> None:
    parser = JsonParser(off_loop_bytes=THRESHOLD)
    assert asyncio.run(_parse(parser, b'{"a": 1}')) == {"a": 1}
    assert parser.parsed_off_loop == 0


def test_the_loop_runs_while_a_large_body_is_parsed() -> None:
    async def main() -> int:
        parser = JsonParser(off_loop_bytes=THRESHOLD)
        await parser.parse(_big(0))  # the child is started
        ticks = 0
        parsing = asyncio.create_task(parser.parse(json.dumps(
            {"prompt": "the lazy dog " * (4 << 20)}).encode()))

        while not parsing.done():
            ticks += 1
            await asyncio.sleep(0)
        assert len((await parsing)["prompt"]) == 13 * (4 << 20)
        await parser.close()
        return ticks

    assert asyncio.run(main()) > 1  # inline, the loop would not turn once during the parse


def test_a_dead_child_is_replaced() -> None:
    async def main() -> None:
        parser = JsonParser(off_loop_bytes=THRESHOLD)
        assert (await parser.parse(_big(1)))["x"] == 1
        process = parser._process
        assert process is not None
        process.kill()
        await process.wait()
        assert (await parser.parse(_big(2)))["x"] == 2  # inline this once, or a new child
        assert (await parser.parse(_big(3)))["x"] == 3
        assert parser._process is not None and parser._process.returncode is None
        await parser.close()

    asyncio.run(main())
