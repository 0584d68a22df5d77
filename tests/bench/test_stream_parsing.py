"""``bench serve``'s SSE parsing against a scripted loopback server, and its edge timelines.

The server writes exactly the bytes a test gives (multi-token chunks, a usage chunk, [DONE],
malformed events, error statuses), so what ``send_request`` makes of them is checked without
an engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from benchmarks.serve.client import (
    RequestOutput,
    StreamTimeline,
    count_output_tokens,
    send_request,
)
from benchmarks.serve.metrics import compute_metrics, request_tpot


def _event(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


def _chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


async def _serve_once(events: Sequence[bytes], status: int = 200,
                      body: bytes = b"") -> RequestOutput:
    """Serve one response on 127.0.0.1 and return what ``send_request`` measured of it."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if status != 200:
            return web.Response(status=status, body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(0.005)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            return await send_request(session, f"http://127.0.0.1:{port}/v1/completions",
                                      {"prompt": "x"}, prompt_len=3, headers={})
    finally:
        await runner.cleanup()


def test_multi_token_chunks_usage_chunk_and_done() -> None:
    """Output tokens come from usage (not the chunk count), one ITL gap per chunk, nothing
    after [DONE] is read, and the usage chunk ends neither TTFT nor E2EL."""
    events = [_event(_chunk("ab")), _event(_chunk("cd ef")), _event(_chunk("g")),
              _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}),
              _event(b"[DONE]"), _event(_chunk("after done"))]
    out = asyncio.run(_serve_once(events))
    assert out.success and out.error is None and out.status == 200
    assert out.output_tokens == 7 and len(out.itl) == 2
    assert 0 < out.ttft <= out.latency
    assert out.latency == pytest.approx(out.ttft + sum(out.itl), abs=1e-6)
    assert request_tpot(out) == pytest.approx((out.latency - out.ttft) / 6)


def test_non_object_event_fails_the_request_not_the_run() -> None:
    """``data: null`` (valid JSON, no object) was a TypeError that ended the whole run."""
    out = asyncio.run(_serve_once([_event(_chunk("a")), _event(b"null"), _event(b"[DONE]")]))
    assert not out.success and "bad SSE event" in out.error
    timeline = StreamTimeline(0.0, 3)
    timeline.feed(5, 0.1)
    assert not timeline.finish().success


def test_http_error_is_a_failed_request_with_its_message() -> None:
    body = json.dumps({"error": {"message": "the engine is asleep", "code": 503}}).encode()
    out = asyncio.run(_serve_once([], status=503, body=body))
    assert not out.success and out.status == 503
    assert out.error == "HTTP 503: the engine is asleep"
    result = compute_metrics([out], 1.0, ("ttft", "tpot", "itl", "e2el"), (99,))
    assert result["completed"] == 0 and result["failed"] == 1
    assert result["total_output_tokens"] == 0 and result["mean_ttft_ms"] is None


def test_contentless_stream_is_timed_to_its_last_chunk() -> None:
    """Choices whose text is always empty (tokens that detokenize to nothing): TTFT at the
    first chunk, ITL the gaps, E2EL at the last chunk with choices (vLLM's timing); it used
    to end E2EL at the first chunk, so TPOT came out 0 for a 3-token request."""
    sent_at = 10.0
    timeline = StreamTimeline(sent_at, 5)
    for offset in (0.1, 0.3, 0.6):
        timeline.feed(_chunk(""), sent_at + offset)
    timeline.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
                  sent_at + 0.61)
    out = timeline.finish()
    assert out.success and out.output_tokens == 3
    assert out.ttft == pytest.approx(0.1)
    assert out.itl == pytest.approx([0.2, 0.3])
    assert out.latency == pytest.approx(0.6)
    assert request_tpot(out) == pytest.approx(0.25)


class _WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))


def test_without_usage_output_tokens_are_the_generated_texts_tokens() -> None:
    """A server that reports no usage and sends several tokens per chunk: output tokens are
    the tokens of the generated text (vLLM's count), not the number of chunks (3 here),
    which understated output throughput and overstated TPOT."""
    events = [_event(_chunk("ab cd")), _event(_chunk("")), _event(_chunk(" ef gh ij")),
              _event(_chunk(" kl")), _event(b"[DONE]")]
    out = asyncio.run(_serve_once(events))
    assert out.success and out.generated_text == "ab cd ef gh ij kl"
    count_output_tokens([out], _WordTokenizer())
    assert out.output_tokens == 6
    assert request_tpot(out) == pytest.approx((out.latency - out.ttft) / 5)


def test_reported_usage_is_kept_and_failures_are_not_counted() -> None:
    timeline = StreamTimeline(0.0, 3)
    timeline.feed(_chunk("a b c d"), 0.1)
    timeline.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9}}, 0.2)
    with_usage = timeline.finish()
    failed = RequestOutput(error="HTTP 500: boom")
    count_output_tokens([with_usage, failed], _WordTokenizer())
    assert with_usage.output_tokens == 9 and failed.output_tokens == 0
