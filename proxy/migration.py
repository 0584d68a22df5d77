"""Request migration: a decode leg that fails or stalls is continued on another worker.

Before any byte reached the client a failed leg is simply tried again elsewhere
(``Migrate``, raised by the dispatcher and counted against ``--migration-limit``). After
bytes went out, ``StreamMigration._stream_into`` relays the stream event by event, and each
event's SSE comment ``: pdserve_token_ids=...`` (asked for with ``stream_token_ids``,
stripped here) says which output tokens the client now holds. When the leg dies (reset,
truncated stream, an SSE error event, no byte within the stall deadline, its worker
dropped from the registry) the request is sent to another worker with those tokens as
``generated_token_ids``: the worker recomputes prompt and tokens, counts them as output
(usage covers the whole request, ``max_tokens`` bounds the total) and streams only what
follows, so the client sees one unbroken stream. Only complete events are relayed, so a
cut never leaves half an event behind.

A stream can continue when the client holds exactly what the tokens say: one choice, no
stop strings (held-back text) and no logprobs (their offsets) or echo. Others end with an
SSE error event as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from engine_core.cluster.messages import CAP_DECODE, CAP_WHOLE, ROLE_COLOCATED, ROLE_DECODE
from engine_core.errors import UpstreamError, UpstreamTimeoutError
from engine_core.server.http_errors import sse_error_event
from engine_core.server.streaming import TOKEN_IDS_COMMENT, SSEStream
from proxy import forwarding as fw
from proxy.client_stream import end_stream
from proxy.legs import Leg, RequestTimer, Retry, abort_tasks
from proxy.registry import WorkerState

if TYPE_CHECKING:
    from proxy.dispatcher import Dispatcher

logger = logging.getLogger("proxy.dispatcher")

RESUME: Any = web.RequestKey("resume", object) if hasattr(web, "RequestKey") else "pdserve_resume"
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'


class WorkerErrorEvent(UpstreamError):
    """A worker ended its stream with an error event (``event``, relayed when the stream
    cannot continue elsewhere)."""

    def __init__(self, message: str, event: bytes) -> None:
        super().__init__(message, kind="error_event")
        self.event = event + b"data: [DONE]\n\n"


class Migrate(Retry):
    """A decode (or whole-request) leg failed before any byte reached the client: the
    request goes to another worker, counted as a migration, not a retry."""


@dataclass
class Resume:
    """What continuing one client request elsewhere needs: its body and route keys, the
    output tokens the client holds, the workers already tried, the migrations so far."""

    path: str
    body: dict[str, Any]
    model: str | None
    key: str | None
    excluded: set[str]
    continuable: bool  # a stream of it can go on elsewhere after its first byte
    token_ids: list[int] = field(default_factory=list)
    migrations: int = 0


def continuable(path: str, body: dict[str, Any]) -> bool:
    """Whether the client of a stream holds exactly the text of the tokens it was sent
    (see the module docstring)."""
    if body.get("stop") not in (None, []) or body.get("echo"):
        return False
    logprobs = body.get("logprobs")
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs") is not None:
        return False
    if body.get("n") not in (None, 1):
        return False
    if path != fw.CHAT_PATH:
        prompt = body.get("prompt")
        return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    return True


@dataclass
class EventBatch:
    """What one read of a worker's stream gives: the complete events to relay, the output
    tokens they complete, and how the stream ended in them (None: it goes on)."""

    data: bytes
    token_ids: list[int]
    end: str | None  # "done" ([DONE] seen) or "error" (an error event, not relayed)
    error_event: bytes = b""  # the worker's own error event, for a stream that ends with it


class SSEEvents:
    """Splits a worker's SSE bytes into whole events, strips their token-id comments."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> EventBatch:
        """The complete events of ``chunk`` (with what came before it); an incomplete
        last event waits for the next chunk. Nothing after ``[DONE]`` or an error event
        is relayed."""
        buffer = self._tail + chunk
        out: list[bytes] = []
        token_ids: list[int] = []
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            event = buffer[start:end]
            start = end + 2
            if event.startswith(TOKEN_IDS_COMMENT):
                line_end = event.find(b"\n")
                ids = event[len(TOKEN_IDS_COMMENT):line_end if line_end >= 0 else len(event)]
                token_ids.extend(int(t) for t in ids.split(b",") if t)
                event = event[line_end + 1:] if line_end >= 0 else b""
                if not event:
                    continue
            if event.startswith(_ERROR):
                self._tail = b""
                return EventBatch(b"".join(out), token_ids, "error", event + b"\n\n")
            out.append(event + b"\n\n")
            if event == _DONE:
                self._tail = b""
                return EventBatch(b"".join(out), token_ids, "done")
        self._tail = buffer[start:]
        return EventBatch(b"".join(out), token_ids, None)


class LegWatch:
    """Open decode legs by worker, so a worker whose heartbeats stopped cuts its legs at
    once instead of at their deadlines (one that deregistered is draining: it finishes
    them, and a leg it fails migrates as any other)."""

    def __init__(self) -> None:
        self._lost: dict[str, set[asyncio.Future[None]]] = {}

    def watch(self, worker_id: str) -> asyncio.Future[None]:
        """A future done when ``worker_id`` leaves; pass it to ``forget`` when done."""
        lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lost.setdefault(worker_id, set()).add(lost)
        return lost

    def forget(self, worker_id: str, lost: asyncio.Future[None]) -> None:
        watchers = self._lost.get(worker_id)
        if watchers is not None:
            watchers.discard(lost)
            if not watchers:
                del self._lost[worker_id]

    def worker_removed(self, worker_id: str) -> None:
        """The registry's expiry listener."""
        for lost in self._lost.pop(worker_id, ()):
            if not lost.done():
                lost.set_result(None)


async def within(awaitable: Any, timeout_s: float | None, lost: asyncio.Future[None] | None,
                 what: str) -> Any:
    """``awaitable``'s result unless ``timeout_s`` passes (``UpstreamTimeoutError``) or
    ``lost`` ends first (the worker left: ``UpstreamError`` kind ``lost``)."""
    task = asyncio.ensure_future(awaitable)
    waits: set[asyncio.Future[Any]] = {task} if lost is None else {task, lost}
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await abort_tasks(task)
        raise
    if task in done:
        return task.result()
    await abort_tasks(task)
    if lost is not None and lost.done():
        raise UpstreamError(f"{what}: the worker left the registry", kind="lost")
    raise UpstreamTimeoutError(f"{what}: no byte within {timeout_s:g} s")


class StreamMigration:
    """``Dispatcher``'s relay of event streams, which continues a failed one elsewhere."""

    async def _read_event_chunk(self: Dispatcher, response: aiohttp.ClientResponse) -> bytes:
        """The next bytes of a stream within the stall deadline: a loop timer that closes
        the response, not a task per chunk (``wait_for`` makes one on Python 3.10-3.11)."""
        stalled = False

        def expire() -> None:
            nonlocal stalled
            stalled = True
            response.close()

        timer = asyncio.get_running_loop().call_later(self.timeouts.stall_s, expire)
        try:
            chunk = await fw.read_chunk(response)
        except UpstreamError:
            if not stalled:
                raise
            chunk = b""
        finally:
            timer.cancel()
        if stalled:
            raise UpstreamTimeoutError(f"worker {response.url} sent no byte for "
                                       f"{self.timeouts.stall_s:g} s")
        return chunk

    async def _copy_events(self: Dispatcher, stream: SSEStream, response: aiohttp.ClientResponse,
                           leg: Leg, resume: Resume | None, first: bytes,
                           timer: RequestTimer) -> UpstreamError | None:
        """Relay one worker's events until ``[DONE]`` (None) or its failure (returned; a
        worker's error event as a ``WorkerErrorEvent``)."""
        events = SSEEvents()
        lost = self.leg_watch.watch(leg.worker.worker_id)
        lost.add_done_callback(lambda _: response.close())
        try:
            chunk = first
            while True:
                if not chunk:
                    chunk = await self._read_event_chunk(response)
                    if not chunk:
                        kind = "lost" if lost.done() else "disconnect"
                        return UpstreamError(f"{leg.role} worker {leg.worker.worker_id} ended "
                                             "its stream without [DONE]", kind=kind)
                batch = events.feed(chunk)
                chunk = b""
                if batch.data:
                    await stream.write(batch.data)
                if resume is not None:
                    resume.token_ids.extend(batch.token_ids)
                if batch.end == "error":
                    return WorkerErrorEvent(f"{leg.role} worker {leg.worker.worker_id} sent an "
                                            "error event", batch.error_event)
                if batch.end == "done":
                    timer.upstream_done = self.clock()
                    with contextlib.suppress(UpstreamError):  # its end lets the connection
                        while await self._read_event_chunk(response):  # be reused
                            pass
                    return None
        except UpstreamError as err:
            return UpstreamError(str(err), kind="lost") if lost.done() else err
        finally:
            self.leg_watch.forget(leg.worker.worker_id, lost)

    async def _stream_into(self: Dispatcher, stream: SSEStream, response: aiohttp.ClientResponse,
                           leg: Leg, attempt_id: str, timer: RequestTimer,
                           first: bytes) -> web.StreamResponse:
        """Copy a worker's event stream (after ``first``, already read) to the prepared
        client response; a leg that fails is continued on another worker while the
        request allows it (``Resume``), else the stream ends with an SSE error event."""
        resume: Resume | None = stream.request.get(RESUME)
        own: list[tuple[Leg, aiohttp.ClientResponse]] = []  # continuation legs opened here
        try:
            while True:
                err = await self._copy_events(stream, response, leg, resume, first, timer)
                if err is None:
                    leg.finish()
                    if resume is not None and self.placer is not None:
                        self.placer.stream_finished(len(resume.token_ids))
                    break
                leg.finish(err)
                logger.warning("request %s: stream from %s failed after bytes went out: %s",
                               attempt_id, leg.worker.worker_id, err)
                nxt = await self._continue_stream(stream.request, resume, leg.worker, err,
                                                  attempt_id)
                if nxt is None:
                    await stream.write(err.event if isinstance(err, WorkerErrorEvent)
                                       else sse_error_event(err))
                    break
                leg, response = nxt
                own.append(nxt)
                first = b""
            await stream.write_eof()
        except ConnectionResetError:
            # The client went away, or was sent away (streaming.ClientStalledError): the
            # caller's finally closes its legs, this one's.
            pass
        finally:
            for own_leg, own_response in own:
                own_leg.finish(aborted=True)
                own_response.close()
        return stream.response

    async def _continue_or_end(self: Dispatcher, stream: SSEStream, failed: WorkerState,
                               err: UpstreamError, attempt_id: str,
                               timer: RequestTimer) -> web.StreamResponse:
        """A stream whose leg failed before its worker sent an event (the handoff's decode
        leg): continued elsewhere, or ended with an SSE error event."""
        nxt = await self._continue_stream(stream.request, stream.request.get(RESUME), failed,
                                          err, attempt_id)
        if nxt is None:
            return await end_stream(stream, err)
        leg, response = nxt
        try:
            return await self._stream_into(stream, response, leg, attempt_id, timer, b"")
        finally:
            leg.finish(aborted=True)
            response.close()

    def _migration_target(self: Dispatcher, resume: Resume) -> WorkerState | None:
        """Another worker that can decode the request computing its prompt itself: a decode
        worker, else one serving whole requests."""
        pool = self.registry.candidates(None, resume.model, resume.excluded)
        for capability, role in ((CAP_DECODE, ROLE_DECODE), (CAP_WHOLE, ROLE_COLOCATED)):
            others = [w for w in pool if capability in w.capabilities]
            if others:
                return self.policy.choose(role, others, resume.key)
        return None

    def count_migration(self: Dispatcher, resume: Resume, reason: str) -> bool:
        """Count one migration; False when it would pass ``--migration-limit``."""
        if resume.migrations >= self.migration_limit:
            self.metrics.migrations.labels("limit").inc()
            return False
        resume.migrations += 1
        self.metrics.migrations.labels(reason).inc()
        return True

    async def _continue_stream(self: Dispatcher, request: web.Request, resume: Resume | None,
                               failed: WorkerState, err: UpstreamError, attempt_id: str
                               ) -> tuple[Leg, aiohttp.ClientResponse] | None:
        """A leg to another worker continuing the stream after the tokens the client holds,
        once its first byte arrived; None when the request cannot continue (not
        continuable, the limit reached, no worker left): its error event then ends it."""
        if resume is None or not resume.continuable:
            return None
        while True:
            resume.excluded.add(failed.worker_id)
            if not self.count_migration(resume, err.kind):
                return None
            target = self._migration_target(resume)
            if target is None:
                logger.warning("request %s: no worker left to continue it on", attempt_id)
                return None
            logger.warning("request %s: continuing after %d tokens on %s (%s)", attempt_id,
                           len(resume.token_ids), target.worker_id, err)
            leg = Leg(self, target, "decode")
            try:
                return leg, await self._open_continuation(request, resume, target, attempt_id)
            except UpstreamError as exc:
                leg.finish(exc)
                failed, err = target, exc

    async def _open_continuation(self: Dispatcher, request: web.Request, resume: Resume,
                                 target: WorkerState, attempt_id: str) -> aiohttp.ClientResponse:
        """The continuation's response once its stream began (within the first-byte
        deadline); ``UpstreamError`` otherwise."""
        lost = self.leg_watch.watch(target.worker_id)
        try:
            response = await within(fw.open_leg(
                self.session, target.url + resume.path,
                fw.continuation_body(resume.body, resume.token_ids),
                fw.leg_headers(request.headers, attempt_id), self.timeouts.decode()),
                self.timeouts.first_byte_s, lost, f"continuation on {target.worker_id}")
        finally:
            self.leg_watch.forget(target.worker_id, lost)
        if 200 <= response.status < 300 and fw.is_event_stream(response):
            return response
        try:
            data = await fw.read_body(response, 64 << 10)
        except UpstreamError as exc:
            data = str(exc).encode()
        finally:
            response.close()
        raise UpstreamError(f"decode worker {target.worker_id} answered {response.status}: "
                            f"{data[:300].decode(errors='replace')}", kind="status",
                            status=response.status)
