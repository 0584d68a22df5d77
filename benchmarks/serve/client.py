"""One streamed OpenAI request and what the benchmark measures of it.

Timing follows ``vllm bench serve``: TTFT is the time from sending to the first streamed
chunk carrying content (text, or a chat delta's content or reasoning: a reasoning model
streams its thinking first, and those are generated tokens too); after it, every chunk with
choices adds one inter-token gap (ITL); E2EL ends at the last chunk with choices. Output
tokens come from the usage the server reports (``stream_options.include_usage``); without
it, ``count_output_tokens`` tokenizes the generated text after the run (a chunk may carry
several tokens, or none), as vLLM does. A stream whose choices never carry content (say every
token detokenizes to nothing) is timed as vLLM times it: TTFT at its first chunk with
choices, ITL between the later ones, E2EL at its last. An event that is not a JSON object
fails the request instead of the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.serve.breakdown import request_stages
from benchmarks.serve.datasets import SampleRequest


@dataclass
class RequestOutput:
    """The measured result of one request (seconds unless named otherwise)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    start_offset: float = 0.0  # when it was sent, from the run's start
    cached_tokens: int | None = None
    generated_text: str = ""
    usage_reported: bool = False  # output_tokens is the server's; else counted from the text
    status: int | None = None
    error: str | None = None
    server: dict[str, float] = field(default_factory=dict)  # breakdown stage -> ms


class StreamTimeline:
    """Folds the events of one SSE response, as they arrive, into a ``RequestOutput``."""

    def __init__(self, sent_at: float, prompt_len: int) -> None:
        self.sent_at = sent_at
        self.output = RequestOutput(prompt_len=prompt_len)
        self.server_timings: dict[str, Any] | None = None
        self._last: float | None = None
        self._choice_times: list[float] = []  # chunks with choices before the first content
        self._content_chunks = 0
        self._usage_tokens: int | None = None

    def feed(self, data: Any, now: float) -> None:
        """One decoded ``data:`` event received at ``now`` (perf_counter seconds)."""
        if not isinstance(data, dict):  # ``data: null``, a bare number: not an OpenAI event
            self.output.error = f"bad SSE event: {str(data)[:200]!r}"
            return
        if "error" in data and not data.get("choices"):
            error = data["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.output.error = f"stream error: {message}"
            return
        if isinstance(data.get("pdserve_timings"), dict):
            self.server_timings = data["pdserve_timings"]
        usage = data.get("usage")
        if isinstance(usage, dict):
            self._usage_tokens = usage.get("completion_tokens")
            if usage.get("prompt_tokens"):
                self.output.prompt_len = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            self.output.cached_tokens = details.get("cached_tokens")
        choices = data.get("choices")
        if not choices:
            return
        content = _chunk_text(choices[0])
        if self.output.ttft is None:
            if not content:
                self._choice_times.append(now)
                return
            self.output.ttft = now - self.sent_at
        else:
            self.output.itl.append(now - self._last)
        if content:
            self._content_chunks += 1
            self.output.generated_text += content
        self._last = now

    def finish(self, headers: Any = None) -> RequestOutput:
        """The result once the stream ended (``[DONE]`` or end of body)."""
        out = self.output
        if out.ttft is None and self._choice_times:
            self._time_contentless()
        if out.error is None and out.ttft is None:
            out.error = "the stream ended without any choice"
        if out.error is None:
            out.success = True
            out.latency = self._last - self.sent_at
            out.usage_reported = bool(self._usage_tokens)  # 0: recounted, as vLLM does
            out.output_tokens = (self._usage_tokens if out.usage_reported
                                 else self._content_chunks)
        out.server = request_stages(headers or {}, self.server_timings)
        return out

    def _time_contentless(self) -> None:
        """Choices but never content: every chunk with choices counts, as vLLM counts them
        (TTFT the first, ITL the gaps, E2EL the last), not just the first one."""
        times = self._choice_times
        self.output.ttft = times[0] - self.sent_at
        self.output.itl = [later - earlier for earlier, later in zip(times, times[1:])]
        self._last = times[-1]


def _chunk_text(choice: dict[str, Any]) -> str:
    """The generated text of one chunk's choice: a completion's ``text``, or a chat delta's
    reasoning then its content. Reasoning models stream their thinking as
    ``reasoning_content`` (newer vLLM servers: ``reasoning``) before any ``content``, and it
    is output the server counts in its usage, so it times the first token as vLLM does."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    content = delta.get("content")
    return ((reasoning if isinstance(reasoning, str) else "")
            + (content if isinstance(content, str) else ""))


def count_output_tokens(outputs: Iterable[RequestOutput], tokenizer: Any) -> None:
    """Set the output tokens of successful requests whose server reported no usage to the
    tokens of their generated text (vLLM's count); done after the run, off the clock."""
    for out in outputs:
        if out.success and not out.usage_reported:
            out.output_tokens = len(tokenizer.encode(out.generated_text,
                                                     add_special_tokens=False))


def build_payload(model: str, request: SampleRequest, chat: bool, ignore_eos: bool,
                  temperature: float, text: str | None = None) -> dict[str, Any]:
    """The JSON body of one streamed request (``text``: the prompt decoded, for chat)."""
    body: dict[str, Any] = {"model": model, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": text if text is not None
                             else request.prompt}]
        body["max_completion_tokens"] = request.expected_output_len
    else:
        body["prompt"] = request.prompt
        body["max_tokens"] = request.expected_output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _error_text(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body[:300].decode(errors='replace')}"


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict[str, Any],
                       prompt_len: int, headers: dict[str, str],
                       run_start: float = 0.0) -> RequestOutput:
    """POST one streamed request and time it; never raises for a failed request."""
    sent_at = time.perf_counter()
    timeline = StreamTimeline(sent_at, prompt_len)
    timeline.output.start_offset = sent_at - run_start if run_start else 0.0
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            timeline.output.status = response.status
            if response.status != 200:
                timeline.output.error = _error_text(response.status, await response.read())
                return timeline.output
            async for raw in response.content:
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    timeline.output.error = f"bad SSE event: {data[:200]!r}"
                    break
                timeline.feed(event, now)
            return timeline.finish(response.headers)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        # ValueError: aiohttp's limit on one SSE line
        timeline.output.error = f"{type(exc).__name__}: {exc}"
        return timeline.output
