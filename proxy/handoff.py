"""The first-token handoff (on by default; ``--no-first-token-from-prefill`` turns it
off): P alone first; the stream events of P's sampled token of each choice go to the client
as soon as P answers, then D's leg leaves carrying those tokens and D streams what follows
them. The client's first token then costs P's prefill and nothing of D. A mixin of
``Dispatcher``, whose legs, retries and releases it uses.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from engine_core.cluster.messages import CAP_DECODE, CAP_WHOLE, ROLE_COLOCATED, ROLE_DECODE
from engine_core.errors import UpstreamError, UpstreamTimeoutError, UpstreamUnavailableError
from proxy import forwarding as fw
from proxy.client_stream import end_stream
from proxy.legs import (
    HeldKV,
    Leg,
    RequestTimer,
    Retry,
    abort_tasks,
    breakdown_headers,
    took_nothing,
)
from proxy.migration import RESUME
from proxy.routing import Route

if TYPE_CHECKING:
    from proxy.dispatcher import Dispatcher

logger = logging.getLogger("proxy.dispatcher")


class FirstTokenHandoff:
    """``Dispatcher``'s handoff path (``_run_pd_handoff``)."""

    async def _run_pd_handoff(self: Dispatcher, request: web.Request, path: str, body: dict[str, Any],
                              route: Route, attempt_id: str, timer: RequestTimer,
                              model: str | None, key: str | None) -> web.StreamResponse:
        """P first; its sampled token goes to the client at once and D continues after it.

        D's leg leaves only once P answered (it must carry P's token), so D pulls the
        prompt's KV from the blocks P holds for it. Until P answered nothing went out and a
        failure is retried as in ``_run_pd``; after that the stream is the client's, and a D
        that cannot be reached (or is asleep) is replaced by another decode worker: it never
        got the request, so P's held KV is still there for the next one to pull (a failed
        pull falls back to computing the prompt there). Anything else continues the stream
        where its prompt is computed again (``proxy/migration.py``) or ends it with an SSE
        error event, and P's KV is released then. ``model`` and ``key`` route that
        replacement as the request was routed.
        """
        prefill, decode = route.prefill, route.decode
        assert prefill is not None and prefill.zmq_address and decode.zmq_address
        headers = fw.leg_headers(request.headers, attempt_id)
        p_leg = Leg(self, prefill, "prefill", route.prefill_tokens)
        timer.prefill_sent = self.clock()
        grant = self._grant(attempt_id, prefill, decode)
        held = HeldKV(prefill, decode, fw.prompt_transfer_ids(path, body, attempt_id), grant)
        p_task = asyncio.create_task(self._prefill(
            prefill.url + path, fw.handoff_prefill_body(body, attempt_id, decode.zmq_address,
                                                        grant, decode.kv_ranks),
            headers))
        try:
            try:
                await asyncio.wait({p_task})
                verdict = self._prefill_verdict(p_task, p_leg, attempt_id, timer)
            finally:
                p_leg.finish(aborted=True)
                await abort_tasks(p_task)
        except asyncio.CancelledError:
            # The client left while P computed, or just after it answered: its leg is cut
            # (an abort landing after its save would leave the KV held), and P is told.
            self._spawn_release(held)
            raise
        if isinstance(verdict, web.Response):
            return verdict
        first = fw.first_token_of(verdict, fw.num_choices(body))
        if first is None:  # an older P, or one that sampled nothing: D computes the token
            # Counted unless this D sends the request round again (unreachable, asleep):
            # then the attempt that serves it counts it, so one request counts once.
            retried = False
            try:
                response = await self._run_one_leg(
                    request, path, fw.decode_body(body, attempt_id, prefill.zmq_address, grant,
                                                  prefill_ranks=prefill.kv_ranks),
                    decode, "decode", attempt_id, timer)
                if took_nothing(response.status):  # P holds KV D will never pull
                    self._spawn_release(held)
                return response
            except Retry:  # tried again under a new transfer id: P's KV is not pulled
                retried = True
                self._spawn_release(held)
                raise
            except (UpstreamError, asyncio.CancelledError):
                # D's refusal could not be read, or the client left: D's leg is cut (a
                # release after D took the request finds the KV gone and does nothing).
                self._spawn_release(held)
                raise
            finally:
                if not retried:
                    self.metrics.first_token_handoffs.labels("decode").inc()
        self.metrics.first_token_handoffs.labels("prefill").inc()
        out = web.StreamResponse(status=200, headers={
            "Content-Type": fw.SSE_CONTENT_TYPE, "Cache-Control": "no-cache",
            "X-Request-Id": attempt_id, **breakdown_headers(timer)})
        try:
            stream = await self._open_stream(request, out)
            await stream.write(first.events)
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            # The client left before any decode leg went out: nobody will pull P's KV.
            self._spawn_release(held)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return out
        timer.first_byte = self.clock()
        resume = request.get(RESUME)
        if resume is not None and resume.continuable:  # one choice; the client holds P's
            resume.token_ids.extend(first.token_ids[0])  # token: a migration follows it
        excluded = {prefill.worker_id}
        granted = decode
        released = False  # P's KV: released once, under the grant P saved it for (``held``)

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._spawn_release(held)

        for attempt in range(self.max_attempts):
            if released:  # a worker that computes the prompt itself: it names no KV
                d_body = fw.decode_body(body, attempt_id, None,
                                        generated_token_ids=first.token_ids)
            else:
                if decode is not granted:  # a replacement decode worker: its own grant
                    grant, granted = self._grant(attempt_id, prefill, decode), decode
                d_body = fw.handoff_decode_body(body, attempt_id, prefill.zmq_address,
                                                first.token_ids, grant, prefill.kv_ranks)
            d_leg = Leg(self, decode, "decode")
            d_task = asyncio.create_task(fw.open_leg(
                self.session, decode.url + path, d_body, headers, self.timeouts.decode()))
            settling = False  # D's leg handed to ``_settle_decode``
            try:
                try:
                    try:
                        # Not ``await d_task``: a client leaving now would cancel the leg
                        # with it, and whether D took the request (its abort then frees the
                        # KV) or not (P must be told) would stay unknown.
                        await asyncio.wait({d_task}, timeout=self.timeouts.first_byte_s)
                    except asyncio.CancelledError:
                        settling = not released and self._spawn(
                            self._settle_decode(d_task, d_leg, held))
                        if not settling:  # no slot: D's leg is cut, and P told at once
                            release()
                        raise
                    if not d_task.done():
                        d_task.cancel()
                        raise UpstreamTimeoutError(f"decode worker {decode.worker_id} sent no "
                                                   f"byte for {self.timeouts.first_byte_s:g} s")
                    d_response = d_task.result()
                    if d_response.status == 503 and attempt + 1 < self.max_attempts:
                        try:
                            data = await fw.read_body(d_response, self.max_response_bytes)
                        except asyncio.CancelledError:  # the client left; D took nothing
                            release()
                            raise
                        raise UpstreamUnavailableError(
                            f"decode worker {decode.worker_id} is unavailable: "
                            f"{data[:300].decode(errors='replace')}")
                except UpstreamError as err:
                    d_leg.finish(err)
                    if not (err.connect_failed or isinstance(err, UpstreamUnavailableError)) \
                            or attempt + 1 == self.max_attempts:
                        # Continued where the prompt is computed again (or ended): nobody
                        # pulls P's KV.
                        release()
                        return await self._continue_or_end(stream, decode, err, attempt_id,
                                                           timer)
                    excluded.add(decode.worker_id)
                    # Another decode-capable worker of the first one's KV layout (it pulls
                    # the routes P saved); only when none is left one that serves whole
                    # requests, which recomputes the prompt (P's KV is released): routing
                    # the usual way would skip the decode workers, since with P excluded no
                    # (P, D) pair remains.
                    pool = self.registry.candidates(None, model, excluded)
                    role = ROLE_DECODE
                    others = [w for w in pool if CAP_DECODE in w.capabilities
                              and fw.same_kv_layout(w.kv_ranks, held.decode.kv_ranks)
                              and fw.layout_refusal(prefill.kv_ranks, w.kv_ranks) is None]
                    if not others:  # what serves it now computes the prompt itself
                        release()
                        role = ROLE_COLOCATED
                        others = [w for w in pool if CAP_WHOLE in w.capabilities]
                    if not others:
                        return await end_stream(stream, err)
                    decode = self.policy.choose(role, others, key)
                    logger.warning("request %s: decode leg failed before its first byte (%s); "
                                   "continuing on %s", attempt_id, err, decode.worker_id)
                    self.metrics.retries.labels("handoff_decode").inc()
                    continue
                if not 200 <= d_response.status < 300 or not fw.is_event_stream(d_response):
                    release()  # no decode leg pulls P's KV any more
                    try:
                        data = await fw.read_body(d_response, self.max_response_bytes)
                    except UpstreamError as exc:  # the refusal's body itself failed
                        data = str(exc).encode()
                    err = UpstreamError(
                        f"decode worker {decode.worker_id} answered {d_response.status}: "
                        f"{data[:500].decode(errors='replace')}", kind="status",
                        status=d_response.status)
                    d_leg.finish(err)
                    if took_nothing(d_response.status):
                        return await end_stream(stream, err)
                    return await self._continue_or_end(stream, decode, err, attempt_id, timer)
                return await self._stream_into(stream, d_response, d_leg, attempt_id, timer, b"")
            finally:
                if not settling:
                    d_leg.finish(aborted=True)
                    await abort_tasks(d_task)
        raise AssertionError("unreachable: the last attempt returns")

