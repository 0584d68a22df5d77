"""Work that outlives its client request: a leg settled in the background, and the release
of KV that P holds for a decode leg that will never pull it (``proxy/kv_release.py``).

A mixin of ``Dispatcher``. A settle (a leg left running, awaited in the background) holds
a slot of the ``--max-inflight`` limiter, as it is load on its worker like a client's
request; with none free the leg is cut and P told at once instead. A release holds no slot
(it is one small message per P rank, bounded by the releaser's deadline and socket cap), so
a saturated proxy still frees P's KV; at most ``MAX_PENDING_RELEASES`` wait at once, and one
past that is dropped (counted as ``skipped``: the lease frees that KV). ``aclose`` ends both
at shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp

from engine_core.errors import KVTransferError, UpstreamError
from proxy import forwarding as fw
from proxy.kv_release import release_notices
from proxy.legs import HeldKV, Leg, abort_tasks

if TYPE_CHECKING:
    from proxy.dispatcher import Dispatcher

logger = logging.getLogger("proxy.dispatcher")

MAX_PENDING_RELEASES = 4096


class BackgroundWork:
    """``Dispatcher``'s background settles and KV releases."""

    async def aclose(self: Dispatcher) -> None:
        """Cancel the background settles and releases (shutdown, before the session closes)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self: Dispatcher, work: Coroutine[Any, Any, None]) -> bool:
        """Run a settle in the background under a slot of the limiter; False (``work``
        closed unrun) when every slot is taken: the caller then cuts its leg and releases
        P's KV itself (``_spawn_release``), so refusals that arrive faster than P computes
        cannot pile up work beyond --max-inflight."""
        if not self.limiter.try_acquire():
            work.close()
            return False
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(functools.partial(self._background_done, slot=True))
        return True

    def _spawn_release(self: Dispatcher, held: HeldKV) -> None:
        """Release ``held`` in the background, holding no limiter slot."""
        if self._pending_releases >= MAX_PENDING_RELEASES:
            self.metrics.kv_releases.labels("skipped").inc()
            return
        self._pending_releases += 1
        task = asyncio.create_task(self._release(held))
        self._background.add(task)
        task.add_done_callback(functools.partial(self._background_done, slot=False))

    def _background_done(self: Dispatcher, task: asyncio.Task[None], *, slot: bool) -> None:
        self._background.discard(task)
        if slot:
            self.limiter.release()
        else:
            self._pending_releases -= 1
        if not task.cancelled() and task.exception() is not None:
            logger.error("background work failed", exc_info=task.exception())

    async def _settle_prefill(self: Dispatcher, p_task: asyncio.Task[tuple[int, str, bytes]],
                              p_leg: Leg, held: HeldKV) -> None:
        """P's leg of a request D refused, or failed, while P still ran it: awaited in the
        background (its own deadline bounds it) and its KV released once P says it computed
        it (a retry on the same P then finds the prompt in its prefix cache).

        Not cancelled: an abort landing after P's save would leave the KV held for the
        lease; and only P's answer says whether P took the request, or failed it (then
        nothing is sent)."""
        try:
            await asyncio.wait({p_task})
            try:
                status, _, _ = p_task.result()
            except UpstreamError as err:
                p_leg.finish(err)
                return
            p_leg.finish(None if status < 500 else UpstreamError(
                f"prefill worker {p_leg.worker.worker_id} answered {status}", kind="status",
                status=status))
            if 200 <= status < 300:
                await self._release(held)
        finally:
            p_leg.finish(aborted=True)
            await abort_tasks(p_task)

    async def _release(self: Dispatcher, held: HeldKV) -> None:
        """Make P drop KV that no decode leg will pull now, not when its lease ends: the
        proxy tells each of P's ranks itself (``proxy/kv_release.py``), so it works whatever
        became of D. Best effort: a failure leaves the KV to the lease."""
        try:
            await self.releaser.send(release_notices(held, self.grants))
        except KVTransferError as err:
            self.metrics.kv_releases.labels("failed").inc()
            logger.warning("KV of %s on %s not released (its lease frees it): %s",
                           held.transfer_ids[0], held.prefill.worker_id, err)
            return
        self.metrics.kv_releases.labels("released").inc()

    async def _settle_decode(self: Dispatcher, d_task: asyncio.Task[aiohttp.ClientResponse],
                             d_leg: Leg, held: HeldKV) -> None:
        """D's leg of a handoff whose client left before D answered, awaited in the
        background (for the first-byte deadline at most): a stream (D's engine runs the
        request) is closed, which aborts it there and D's connector frees or releases the
        KV; any other outcome (a refusal, a 503, a 5xx, no connection, no answer in time)
        leaves P's KV to no one, so P is told directly."""
        try:
            await asyncio.wait({d_task}, timeout=self.timeouts.first_byte_s)
            if not d_task.done():
                await abort_tasks(d_task)
                d_leg.finish(aborted=True)
                await self._release(held)
                return
            try:
                response = d_task.result()
            except UpstreamError as err:
                d_leg.finish(err)
                await self._release(held)
                return
            streams = 200 <= response.status < 300 and fw.is_event_stream(response)
            response.close()
            if not streams:
                d_leg.finish()
                await self._release(held)
        finally:
            d_leg.finish(aborted=True)
            await abort_tasks(d_task)
