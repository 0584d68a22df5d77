"""The chaos soak's requests: greedy completions and chats, streamed and whole, and how
each answer is judged against the same request's answer on an undisturbed cluster."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes".split()


@dataclass(frozen=True)
class Probe:
    """One request the clients send again and again."""

    path: str
    stream: bool
    body: dict


@dataclass
class Answer:
    """What one client request saw; judged afterwards, never asserted while reading."""

    status: int = 0
    text: str = ""
    usage: dict | None = None
    error: str | None = None  # non-200 error, or a stream's SSE error event
    done: bool = False  # stream: data: [DONE] arrived
    exception: str | None = None  # client side: timeout, connection cut, bad JSON
    timed_out: bool = False
    started: float = 0.0  # time.monotonic() at send and at the answer's end
    ended: float = 0.0


def probes(model: str, count: int = 12) -> list[Probe]:
    """Completions and chats, streamed and whole, of a few lengths."""
    out = []
    for i in range(count):
        text = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(3 + (i * 7) % 16))
        body: dict = {"model": model, "temperature": 0, "ignore_eos": True,
                      "max_tokens": 8 + 8 * (i % 4)}
        path = "/v1/completions" if i % 4 < 2 else "/v1/chat/completions"
        body |= ({"prompt": text} if path == "/v1/completions"
                 else {"messages": [{"role": "user", "content": text}]})
        stream = bool(i % 2)
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        out.append(Probe(path, stream, body))
    return out


async def send(session: aiohttp.ClientSession, base: str, probe: Probe, timeout_s: float
               ) -> Answer:
    """One request; every failure mode is recorded in the Answer."""
    out = Answer(started=time.monotonic())
    try:
        async with session.post(base + probe.path, json=probe.body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            out.status = response.status
            if response.status != 200:
                out.error = (await response.read()).decode(errors="replace")[:200]
            elif not probe.stream:
                data = json.loads(await response.read())
                choice = data["choices"][0]
                out.text = choice["text"] if "text" in choice else choice["message"]["content"]
                out.usage, out.done = data["usage"], True
            else:
                await _read_stream(response, out)
    except asyncio.TimeoutError:
        out.exception, out.timed_out = f"timeout after {timeout_s}s", True
    except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        out.exception = f"{type(exc).__name__}: {exc}"[:200]
    out.ended = time.monotonic()
    return out


async def _read_stream(response: aiohttp.ClientResponse, out: Answer) -> None:
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            out.done = True
            continue
        event = json.loads(payload)
        if "error" in event:
            out.error = str(event["error"])[:200]
            continue
        for choice in event.get("choices") or []:
            out.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        out.usage = event.get("usage") or out.usage


def _counts(usage: dict | None) -> tuple:
    """The token counts of a usage (its cached-token detail varies with the caches)."""
    usage = usage or {}
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")


def judge(answer: Answer, reference: Answer) -> str:
    """``ok``, or the kind of failure: hang, truncated (a 200 that ended short without an
    error), mismatch, http_<status>, stream_error, cut (the connection broke)."""
    if answer.timed_out:
        return "hang"
    if answer.exception is not None:
        return "cut"
    if answer.status != 200:
        return f"http_{answer.status}"
    if answer.error is not None:
        return "stream_error"
    if not answer.done or answer.usage is None:
        return "truncated"
    if answer.text != reference.text or _counts(answer.usage) != _counts(reference.usage):
        return "mismatch"
    return "ok"
