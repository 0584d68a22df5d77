"""OpenAI response bodies and stream chunks, built from what each choice accumulated, and
how a stream of them ends (``[DONE]``, or an error event after the first byte)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine_core.kv_transfer_params import KVTransferResult
from engine_core.messages import RequestTimings, TokenLogprob
from engine_core.output_processor import LogprobEntry, RequestDelta
from engine_core.server import streaming
from engine_core.server.http_errors import exception_body
from engine_core.server.jobs import Job
from engine_core.server.timings import breakdown

logger = logging.getLogger("pdserve.server")


@dataclass
class ChoiceResult:
    """Everything one choice accumulated, for non-streaming responses and usage."""

    # The text in pieces: one growing string was copied whole at every delta.
    text_pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: KVTransferResult | None = None
    timings: RequestTimings | None = None
    # Characters of the tokens in ``logprobs``: the next entry's ``text_offset`` (the text
    # itself lags it while stop-string or UTF-8 hold-back keeps characters back).
    logprob_chars: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # when the request asked for them

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    def add(self, delta: RequestDelta) -> None:
        self.text_pieces.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        self.logprob_chars += sum(len(entry.token) for entry in delta.logprobs or [])
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_output_tokens = delta.num_output_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params
        if delta.timings is not None:
            self.timings = delta.timings
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def usage(choices: list[ChoiceResult], jobs: list[Job]) -> dict[str, Any]:
    """Each prompt counted once (OpenAI's usage for n samples), every sample's completion."""
    firsts = [c for c, job in zip(choices, jobs, strict=True) if job.sample == 0]
    prompt = sum(len(job.prompt_token_ids) for job in jobs if job.sample == 0)
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}


def completion_logprobs(entries: list[LogprobEntry], offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs; ``offset`` is the text offset of the first."""
    text_offset = []
    for entry in entries:
        text_offset.append(offset)
        offset += len(entry.token)
    top = []
    for entry in entries:
        alternatives = {t.token: t.logprob for t in entry.top}
        alternatives.setdefault(entry.token, entry.logprob)
        top.append(alternatives)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": text_offset}


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """OpenAI's chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": token_bytes(e.token),
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": token_bytes(t.token)}
                          for t in e.top]}
        for e in entries]}


def completion_chunk(head: dict[str, Any], index: int, delta: RequestDelta, offset: int,
                      want_logprobs: bool) -> dict[str, Any]:
    """One /v1/completions stream chunk; ``offset`` is its first logprob's ``text_offset``."""
    return {**head, "choices": [{
        "index": index, "text": delta.text,
        "logprobs": (completion_logprobs(delta.logprobs or [], offset)
                     if want_logprobs else None),
        "finish_reason": delta.finish_reason if delta.finished else None,
        "stop_reason": delta.stop_reason if delta.finished else None}]}


def chat_role_chunk(head: dict[str, Any], index: int) -> dict[str, Any]:
    """The first chunk of a chat stream's choice: the assistant role, no content yet."""
    return {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}


def chat_chunk(head: dict[str, Any], index: int, delta: RequestDelta,
                want_logprobs: bool) -> dict[str, Any]:
    """One /v1/chat/completions stream chunk."""
    return {**head, "choices": [{
        "index": index, "delta": {"content": delta.text} if delta.text else {},
        "logprobs": chat_logprobs(delta.logprobs or []) if want_logprobs else None,
        "finish_reason": delta.finish_reason if delta.finished else None,
        "stop_reason": delta.stop_reason if delta.finished else None}]}


def worth_a_chunk(delta: RequestDelta) -> bool:
    """Deltas with nothing to say (text held back, no logprobs, not finished) send nothing."""
    return bool(delta.text or delta.finished or delta.logprobs)


def add_server_timings(response: dict[str, Any], choices: list[ChoiceResult]) -> None:
    """``pdserve_timings``: a dict for one choice, a list (by index) for several."""
    now_monotonic, now_unix = time.monotonic(), time.time()
    found = [None if c.timings is None else breakdown(c.timings, now_monotonic, now_unix)
             for c in choices]
    if len(found) == 1 and found[0] is not None:
        response["pdserve_timings"] = found[0]
    elif len(found) > 1 and any(t is not None for t in found):
        response["pdserve_timings"] = found


def chunk_sender(sse: streaming.SSEStream, continuous_usage: bool,
                 choices: list[ChoiceResult], jobs: list[Job], stream_token_ids: bool = False
                 ) -> Callable[..., Awaitable[None]]:
    """Sends a stream chunk, with the usage so far when the client asked for
    ``stream_options.continuous_usage_stats``. ``send(chunk, index)`` for choice ``index``
    with ``stream_token_ids`` first names that choice's output tokens not yet named (those
    of deltas that sent no chunk included), so what an event completes is exact. A list
    of chunks (one delta's) goes in one write under one name line: the tokens are the
    events', all or none."""
    named = [0] * len(choices)

    async def send(chunk: dict[str, Any] | list[dict[str, Any]],
                   index: int | None = None) -> None:
        chunks = chunk if isinstance(chunk, list) else [chunk]
        if continuous_usage:
            for each in chunks:
                each["usage"] = usage(choices, jobs)
        data = b"".join(streaming.encode_event(each) for each in chunks)
        if stream_token_ids and index is not None:
            token_ids = choices[index].token_ids
            data = streaming.token_ids_comment(token_ids[named[index]:]) + data
            named[index] = len(token_ids)
        await sse.write(data)

    return send


def add_kv_transfer_params(response: dict[str, Any], choices: list[ChoiceResult]) -> None:
    """The engine's transfer result (the first choice's that has one) on the response."""
    result = next((c.kv_transfer_params for c in choices if c.kv_transfer_params), None)
    if result is not None:
        response["kv_transfer_params"] = result.to_wire()


@contextlib.asynccontextmanager
async def stream_ending(sse: streaming.SSEStream, request_id: str) -> AsyncIterator[None]:
    """Around a stream's chunks: ``[DONE]`` after them, an error event before it when
    they fail. A client sent away for not reading (``ClientStalledError``) ends it
    quietly; the handler then leaves, which aborts the engine requests."""
    try:
        try:
            yield
        except Exception as exc:
            await stream_error(sse, request_id, exc)
        await streaming.send_done(sse)
    except streaming.ClientStalledError:
        pass  # logged and counted when its connection was aborted


async def stream_error(sse: streaming.SSEStream, request_id: str, exc: Exception) -> None:
    """After the first byte an error can only be an SSE event."""
    if isinstance(exc, ConnectionError):
        raise exc
    status, body = exception_body(exc)
    if status == 503:  # shutting down, engine gone: a state, not a bug (no traceback)
        logger.warning("request %s ended mid-stream (503): %s", request_id, exc)
    else:
        log = logger.exception if status >= 500 else logger.info
        log("request %s failed mid-stream: %s", request_id, exc)
    await streaming.send_event(sse, body)
